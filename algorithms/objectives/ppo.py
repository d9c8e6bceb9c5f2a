"""``ppo_clip``: PPO's clipped surrogate with clip-higher and dual clip (``algorithms.policy_loss``)."""

from __future__ import annotations

import torch

from ..losses import policy_loss
from .registry import Metrics, ObjectiveInputs, register_objective


def check_clip(clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float | None = None) -> None:
    """The PPO clip range: ``0 <= clip_low < 1``, ``clip_high >= 0``, ``clip_c`` null or > 1."""
    if not 0 <= clip_low < 1 or clip_high < 0:
        raise ValueError(f"clip_low must be in [0, 1) and clip_high >= 0, got {clip_low}, {clip_high}")
    if clip_c is not None and clip_c <= 1:
        raise ValueError(f"clip_c (dual clip) must be null or > 1, got {clip_c}")


@register_objective("ppo_clip", check=check_clip)
def ppo_clip(x: ObjectiveInputs, *, clip_low: float = 0.2, clip_high: float = 0.2,
             clip_c: float | None = None) -> tuple[torch.Tensor, Metrics]:
    """``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))`` per token, bounded by ``-A clip_c`` where A < 0
    (dual clip); ``r = exp(logp - old_logp)``. The formula and metrics are ``algorithms.policy_loss``'s."""
    return policy_loss(x.logp, x.old_logp, x.advantages, x.mask, clip_low, clip_high, clip_c, x.agg_mode,
                       normalizer=x.normalizer, horizon=x.horizon)
