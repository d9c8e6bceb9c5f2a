"""DAPO's overlong handling (Yu et al. 2025): a soft length penalty before the generation limit, and
truncated samples taken out of the loss.

``overlong_penalty``: with ``L`` the response length, ``L_max`` the limit (``rollout.max_tokens``) and
``c`` the buffer::

    penalty(L) = 0                                 if L <= L_max - c
               = -factor * (L - (L_max - c)) / c   if L_max - c < L <= L_max
               = -factor                           if L > L_max

added to the sequence reward. ``overlong_keep``: a response cut by the limit has no ending to be judged on;
filtering zeroes its loss mask, so it still counts in its group's baseline but trains nothing.
"""

from __future__ import annotations

import torch

__all__ = ["overlong_keep", "overlong_penalty"]


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """The penalty [B] (<= 0, float32) of responses of ``lengths`` [B] (module doc); ``buffer`` 0: all zeros."""
    if buffer < 0 or buffer > max_len:
        raise ValueError(f"overlong buffer must be in [0, max_len={max_len}], got {buffer}")
    n = lengths.to(torch.float32)
    if buffer == 0:
        return torch.zeros_like(n)
    over = (n - (max_len - buffer)).clamp(0.0, float(buffer))
    return -factor * over / buffer


def overlong_keep(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """``mask`` [B, T] with the rows of ``truncated`` [B] (bool) zeroed, in ``mask``'s dtype."""
    return mask * (~truncated.bool()).to(mask.dtype)[:, None]
