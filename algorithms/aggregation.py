"""Reducing a per-token loss matrix [B, T] to a scalar, consistently across micro-batches and ranks.

Every mode is "a sum over the batch divided by a normaliser":

===========================  =====================================================  ==============
mode                         loss                                                   normaliser N
===========================  =====================================================  ==============
``token-mean``               ``sum_{b,t} m*l / N``                                  valid tokens
``token-sum``                ``sum_{b,t} m*l``                                      1 (fixed)
``seq-mean-token-sum``       ``sum_b (sum_t m*l) / N``                              valid seqs
``seq-mean-token-mean``      ``sum_b (sum_t m*l / sum_t m) / N``                    valid seqs
``seq-mean-token-sum-norm``  ``sum_b (sum_t m*l / horizon) / N`` (Dr. GRPO)         valid seqs
===========================  =====================================================  ==============

A "valid sequence" is a row with at least one mask-1 token (all-padding rows are not counted).
The names are verl's ``loss_agg_mode`` values, with the same meaning. ``token-sum`` has no
normaliser: ``agg_loss`` ignores ``normalizer`` for it, so the loss stays the plain masked sum
whatever N a caller computed and all-reduced, and summing it over micro-batches and ranks gives the
sum over the whole batch.

Split invariance. When the batch is split along the batch dimension into micro-batches and every
micro-batch is reduced with the *global* normaliser (``global_normalizer`` of the full mini-batch
mask), ``sum_i agg_loss(micro_i, normalizer=N) == agg_loss(full)`` for **every** mode: the
numerator is a sum over rows, and each row's term depends only on that row (the per-sequence mean of
``seq-mean-token-mean`` included). ``seq-mean-token-sum-norm`` additionally needs the same
``horizon`` for every micro-batch: pass ``horizon`` explicitly when micro-batches are padded to
different lengths (the default, ``loss_mat.shape[-1]``, changes with the padding). Splitting along the
*sequence* dimension (context parallelism) keeps ``token-mean``, ``token-sum``,
``seq-mean-token-sum`` and ``seq-mean-token-sum-norm`` invariant but not ``seq-mean-token-mean``
(the per-row token count must then be the full row's).

Without a normaliser each call uses its own local count, i.e. a mean of micro-batch means, which is
*not* split-invariant (``token-sum`` excepted).

Data parallelism: compute ``N = global_normalizer(mini_batch_mask, mode)`` once per mini-batch before
splitting, ``all_reduce(N, SUM)`` over the data-parallel group, and pass it to every micro-batch.
Each rank's gradients then sum to the global gradient; if the DP wrapper *averages* gradients across
ranks (Megatron DDP does by default), multiply the loss by the DP world size to compensate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["AGG_MODES", "agg_loss", "global_normalizer", "check_agg_mode"]

AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def check_agg_mode(mode: str) -> str:
    """Return ``mode`` or raise ``ValueError`` naming the known modes."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; known modes: {', '.join(AGG_MODES)}")
    return mode


def _valid_rows(mask: torch.Tensor) -> torch.Tensor:
    return (mask.reshape(mask.shape[0], -1) != 0).any(dim=-1)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    horizon: int | float | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` [B, T] under ``mask`` [B, T] into a 0-dim tensor (see module doc).

    ``normalizer``: the divisor N (global token count for ``token-mean``, global number of valid
    sequences for ``seq-mean-*``; ignored by ``token-sum``); ``None`` uses this batch's own count.
    ``horizon``: the constant per-sequence divisor of ``seq-mean-token-sum-norm`` (default
    ``loss_mat.shape[-1]``).
    An empty batch gives 0.
    """
    check_agg_mode(mode)
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss_mat {tuple(loss_mat.shape)} and mask {tuple(mask.shape)} must match")
    m = mask.to(loss_mat.dtype)
    tok_sum = (loss_mat * m).sum(dim=-1)  # [B]
    if mode == "token-sum":
        return tok_sum.sum()
    if mode == "token-mean":
        numerator = tok_sum.sum()
        local_n = m.sum()
    else:
        if mode == "seq-mean-token-sum":
            per_seq = tok_sum
        elif mode == "seq-mean-token-mean":
            per_seq = tok_sum / m.sum(dim=-1).clamp_min(1.0)
        else:  # seq-mean-token-sum-norm
            h = loss_mat.shape[-1] if horizon is None else horizon
            if float(h) <= 0:
                raise ValueError(f"horizon must be positive, got {h}")
            per_seq = tok_sum / float(h)
        numerator = per_seq.sum()
        local_n = _valid_rows(mask).to(loss_mat.dtype).sum()
    if normalizer is None:
        return numerator / local_n.clamp_min(1.0)
    if not isinstance(normalizer, torch.Tensor) and normalizer < 0:
        raise ValueError(f"normalizer must be >= 0, got {normalizer}")
    n = torch.as_tensor(normalizer, dtype=loss_mat.dtype, device=loss_mat.device)
    # A zero normaliser only happens with an empty batch, whose numerator is 0 as well.
    return numerator / n.clamp_min(torch.finfo(loss_mat.dtype).tiny)


def global_normalizer(
    mask_or_masks: torch.Tensor | Sequence[torch.Tensor],
    mode: str = "token-mean",
    horizon: int | float | None = None,
) -> torch.Tensor:
    """The divisor N of ``agg_loss`` for a whole mini-batch, as a 0-dim float32 tensor.

    Takes the full mini-batch mask [B, T] (or a list of micro-batch masks, which may differ in T).
    Returns the mask sum (number of mask-1 tokens) for ``token-mean``, the number of valid sequences (rows
    with at least one mask-1 token) for every ``seq-mean-*`` mode, and 1 for ``token-sum`` (which
    ``agg_loss`` does not divide by anything). ``horizon`` is accepted for a
    uniform signature and only validated: the horizon of ``seq-mean-token-sum-norm`` is passed to
    ``agg_loss``, it is not folded into N. Under data parallelism, all-reduce (SUM) the result.
    """
    check_agg_mode(mode)
    if horizon is not None and float(horizon) <= 0:
        raise ValueError(f"horizon must be positive, got {horizon}")
    masks = [mask_or_masks] if isinstance(mask_or_masks, torch.Tensor) else list(mask_or_masks)
    if not masks:
        raise ValueError("global_normalizer needs at least one mask")
    total = torch.zeros((), dtype=torch.float32, device=masks[0].device)
    if mode == "token-sum":
        return total + 1.0
    for m in masks:
        if mode == "token-mean":
            total = total + m.to(torch.float32).sum()
        else:
            total = total + _valid_rows(m).sum().to(torch.float32)
    return total
