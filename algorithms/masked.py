"""Masked reductions shared by the estimators and losses.

A mask is a 0/1 tensor (bool, int or float) broadcastable to the values; a position with mask 0
contributes nothing. Empty masks never divide by zero: the mean of nothing is 0.
"""

from __future__ import annotations

import torch

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten"]


def _as_float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.to(dtype=like.dtype if like.is_floating_point() else torch.float32)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(values * mask)`` over ``dim`` (all dims when ``None``)."""
    m = _as_float_mask(mask, values)
    prod = values * m
    return prod.sum() if dim is None else prod.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(values * mask) / max(sum(mask), 1)`` over ``dim`` (all dims when ``None``).

    Empty masks give 0 rather than NaN.
    """
    m = _as_float_mask(mask, values)
    m = torch.broadcast_to(m, values.shape)
    num = (values * m).sum() if dim is None else (values * m).sum(dim=dim)
    den = m.sum() if dim is None else m.sum(dim=dim)
    return num / den.clamp_min(1.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked entries (all dims): ``sum(mask * (x - mean)^2) / (n - 1)``.

    With ``unbiased`` the Bessel correction ``n / (n - 1)`` is applied when ``n > 1``; for ``n <= 1``
    the variance is 0.
    """
    m = torch.broadcast_to(_as_float_mask(mask, values), values.shape)
    n = m.sum()
    mean = masked_mean(values, m)
    sq = ((values - mean) ** 2 * m).sum()
    if unbiased:
        return torch.where(n > 1, sq / (n - 1).clamp_min(1.0), torch.zeros_like(sq))
    return sq / n.clamp_min(1.0)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean and unbiased var over the masked entries.

    With ``shift_mean=False`` the mean is added back (only the scale changes). Entries outside
    the mask are transformed too; callers multiply by the mask afterwards.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
