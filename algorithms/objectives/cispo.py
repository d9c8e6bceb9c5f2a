"""``cispo``: Clipped IS-weight Policy Optimization (MiniMax-M1, 2025).

REINFORCE on every token, weighted by its importance ratio clipped and detached, so no token loses its
gradient to the clip (PPO drops the clipped tokens' gradient)::

    l_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * logp_t,   r_t = exp(logp_t - old_logp_t)

MiniMax-M1 leaves the lower bound open (``clip_low`` near 1) and tunes ``clip_high``; its reduction is
``token-mean``.
"""

from __future__ import annotations

import torch

from ..aggregation import agg_loss
from ..masked import masked_mean
from .common import log_ratio, ratio_metrics
from .ppo import check_clip
from .registry import Metrics, ObjectiveInputs, register_objective


@register_objective("cispo", check=check_clip)
def cispo(x: ObjectiveInputs, *, clip_low: float = 0.2, clip_high: float = 0.2) -> tuple[torch.Tensor, Metrics]:
    """CISPO loss (module doc); ``clipfrac``: tokens whose weight was clipped; ``is_weight_mean``: the clipped
    weights' token mean."""
    lr = log_ratio(x.logp, x.old_logp)
    r = torch.exp(lr)
    w = torch.clamp(r, 1.0 - clip_low, 1.0 + clip_high).detach()
    loss = agg_loss(-w * x.advantages * x.logp, x.mask, x.agg_mode, normalizer=x.normalizer, horizon=x.horizon)
    metrics = ratio_metrics(r, lr, (r < 1.0 - clip_low) | (r > 1.0 + clip_high), x.mask)
    metrics["is_weight_mean"] = masked_mean(w, x.mask)
    return loss, metrics
