"""Helpers the objectives share: the clamped log-ratio, per-sequence means and ratio metrics."""

from __future__ import annotations

import torch

from ..masked import masked_mean
from .registry import Metrics

# log-ratios are clamped before exp() so that a wild sample cannot overflow the ratio (as in policy_loss)
LOG_RATIO_CLAMP = 20.0


def log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """``logp - old_logp`` clamped to [-20, 20]."""
    return torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def seq_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked mean of each row [B, T] -> [B]; 0 for an all-padding row."""
    m = mask.to(values.dtype)
    return (values * m).sum(-1) / m.sum(-1).clamp_min(1.0)


def ratio_metrics(ratio: torch.Tensor, lr: torch.Tensor, clipped: torch.Tensor, mask: torch.Tensor) -> Metrics:
    """``clipfrac`` (tokens whose clip or gate is active), ``approx_kl`` (mean ``-lr``), ``ratio_mean`` / ``_max``
    / ``_min`` over the mask-1 tokens; detached. ``ratio`` / ``lr`` / ``clipped`` are [B, T]."""
    with torch.no_grad():
        r, m = ratio.detach(), mask.bool()
        any_tok = m.any()
        one = torch.ones((), dtype=r.dtype, device=r.device)
        return {
            "clipfrac": masked_mean(clipped.to(r.dtype), mask),
            "approx_kl": masked_mean(-lr.detach(), mask),
            "ratio_mean": masked_mean(r, mask),
            "ratio_max": torch.where(any_tok, torch.where(m, r, r.new_full((), -float("inf"))).max(), one),
            "ratio_min": torch.where(any_tok, torch.where(m, r, r.new_full((), float("inf"))).min(), one),
        }
