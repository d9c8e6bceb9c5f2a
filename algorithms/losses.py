"""Policy, value and language-model losses on per-token tensors [B, T].

All losses reduce with ``agg_loss`` (see ``algorithms.aggregation``): pass the global ``normalizer``
to make the result independent of the micro-batch / data-parallel split. Metrics are 0-dim
detached tensors computed over the *local* (micro-)batch, so no device sync is forced.
"""

from __future__ import annotations

import torch

from .aggregation import agg_loss
from .masked import masked_mean

__all__ = [
    "policy_loss",
    "value_loss",
    "entropy_from_logits",
    "logprobs_from_logits",
    "lm_loss",
    "masked_mean",
]

# log-ratios are clamped before exp() so that a wild sample cannot overflow the ratio
_LOG_RATIO_CLAMP = 20.0
# rows of [N, V] logits processed at once by the logsumexp helpers: bounds the temporary memory
_CHUNK_ELEMENTS = 1 << 24

Metrics = dict[str, torch.Tensor]


def _masked_extreme(x: torch.Tensor, mask: torch.Tensor, largest: bool) -> torch.Tensor:
    """Max (or min) of the masked entries; 1.0 (a neutral ratio) when the mask is empty."""
    m = mask.bool()
    fill = float("-inf") if largest else float("inf")
    filled = torch.where(m, x, torch.full_like(x, fill))
    ext = filled.max() if largest else filled.min()
    return torch.where(m.any(), ext, torch.ones_like(ext))


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    agg_mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    horizon: int | float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate with asymmetric clipping (DAPO clip-higher) and optional dual clip.

    All tensors are [B, T]. With ``r = exp(logp - old_logp)`` and advantage ``A``::

        l_clip = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))
        l      = min(l_clip, -A * clip_c)  if A < 0 and clip_c is not None   (dual clip, Ye et al. 2020)
        loss   = agg_loss(l, mask, agg_mode, normalizer, horizon)

    Metrics: ``clipfrac`` (tokens where the clipped term is active), ``dual_clipfrac`` (A < 0 tokens
    bounded by the dual clip), ``approx_kl`` (mean of ``old_logp - logp``), ``ratio_mean``,
    ``ratio_max``, ``ratio_min`` (all over mask-1 tokens).
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"dual-clip constant clip_c must be > 1, got {clip_c}")
    log_ratio = torch.clamp(logp - old_logp, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    dual_active = torch.zeros_like(clip_active)
    if clip_c is not None:
        bound = -advantages * clip_c
        negative = advantages < 0
        dual_active = negative & (loss_mat > bound)
        loss_mat = torch.where(negative, torch.minimum(loss_mat, bound), loss_mat)
    loss = agg_loss(loss_mat, mask, agg_mode, normalizer=normalizer, horizon=horizon)
    with torch.no_grad():
        r = ratio.detach()
        metrics = {
            "clipfrac": masked_mean(clip_active.to(r.dtype), mask),
            "dual_clipfrac": masked_mean(dual_active.to(r.dtype), mask),
            "approx_kl": masked_mean(-log_ratio.detach(), mask),
            "ratio_mean": masked_mean(r, mask),
            "ratio_max": _masked_extreme(r, mask, largest=True),
            "ratio_min": _masked_extreme(r, mask, largest=False),
        }
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_range: float | None = 0.2,
    agg_mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    horizon: int | float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clipped value loss; all tensors [B, T]::

        v_clip = old_values + clip(values - old_values, -clip_range, clip_range)
        l      = 0.5 * max((values - returns)^2, (v_clip - returns)^2)

    ``clip_range=None`` disables clipping (``l = 0.5 * (values - returns)^2``). Metrics:
    ``vf_clipfrac`` (tokens where the clipped error is the larger) and ``vpred_mean``.
    """
    err = (values - returns) ** 2
    if clip_range is None:
        loss_mat = 0.5 * err
        clip_active = torch.zeros_like(err, dtype=torch.bool)
    else:
        if clip_range < 0:
            raise ValueError(f"clip_range must be >= 0, got {clip_range}")
        v_clip = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
        err_clip = (v_clip - returns) ** 2
        loss_mat = 0.5 * torch.maximum(err, err_clip)
        clip_active = err_clip > err
    loss = agg_loss(loss_mat, mask, agg_mode, normalizer=normalizer, horizon=horizon)
    with torch.no_grad():
        metrics = {
            "vf_clipfrac": masked_mean(clip_active.to(values.dtype), mask),
            "vpred_mean": masked_mean(values.detach(), mask),
        }
    return loss, metrics


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32


def _row_chunks(flat: torch.Tensor) -> list[torch.Tensor]:
    rows = max(1, _CHUNK_ELEMENTS // max(1, flat.shape[-1]))
    return list(torch.split(flat, rows, dim=0)) if flat.shape[0] > 0 else [flat]


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of ``softmax(logits)``: [..., V] -> [...].

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v`` (no log of a probability; ``-inf`` logits, e.g. a
    masked vocabulary, contribute 0).
    Computed in float32 for half-precision logits, in row chunks to bound temporary memory.
    """
    dt = _compute_dtype(logits)
    flat = logits.reshape(-1, logits.shape[-1])
    out = []
    for chunk in _row_chunks(flat):
        z = chunk.to(dt)
        z = z - z.detach().amax(dim=-1, keepdim=True)  # H is shift-invariant; avoids cancellation
        p = torch.softmax(z, dim=-1)
        z_finite = torch.where(torch.isneginf(z), torch.zeros_like(z), z)  # p = 0 there; avoids 0 * -inf
        out.append(torch.logsumexp(z, dim=-1) - (p * z_finite).sum(dim=-1))
    return torch.cat(out).reshape(logits.shape[:-1])


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[..., labels]``: logits [..., V], labels [...] -> [...].

    Computed as ``z[label] - logsumexp(z)`` in row chunks, without materialising the full
    log-softmax; float32 for half-precision logits. Negative labels (e.g. ``-100`` ignore ids) are
    gathered as id 0: mask those positions yourself.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} + [V]")
    dt = _compute_dtype(logits)
    flat = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1).clamp_min(0).long()
    out = []
    start = 0
    for chunk in _row_chunks(flat):
        lab = flat_labels[start : start + chunk.shape[0]]
        start += chunk.shape[0]
        z = chunk.to(dt)
        picked = z.gather(-1, lab.unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(z, dim=-1))
    return torch.cat(out).reshape(labels.shape)


def lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    agg_mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    horizon: int | float | None = None,
) -> torch.Tensor:
    """Masked cross-entropy for SFT / pre-training; returns a 0-dim loss.

    Not shifted: ``logits`` [B, T, V] at position t scores ``labels`` [B, T] at position t, so the
    caller aligns them (``logits[:, :-1]`` with ``input_ids[:, 1:]``). ``loss_mask`` [B, T] (default
    all ones) selects the trained positions; positions with a negative label (``-100``) are masked
    out as well. ``loss = agg_loss(-logprobs_from_logits(logits, labels), mask, agg_mode, ...)``.
    """
    valid = labels >= 0
    mask = valid if loss_mask is None else (loss_mask != 0) & valid
    nll = -logprobs_from_logits(logits, labels)
    return agg_loss(nll, mask.to(nll.dtype), agg_mode, normalizer=normalizer, horizon=horizon)
