"""``gspo``: Group Sequence Policy Optimization (Zheng et al. 2025, the objective of Qwen3's RL).

The importance ratio is the sequence's, length-normalised: ``s_i = exp(mean_t(logp_t - old_logp_t))``, and
the clip acts on whole sequences: ``l_i = max(-A_i s_i, -A_i clip(s_i, 1 - clip_low, 1 + clip_high))``.
The paper's clip range is far narrower than PPO's (about 3e-4 / 4e-4).

Written in the paper's GSPO-token form, ``s_i,t = sg(s_i) * exp(logp_t - sg(logp_t))``: each token of a row
carries the sequence's ratio, and its own advantage. With one advantage per sequence (GRPO's) the value and
the gradient equal GSPO's; ``loss_agg_mode: seq-mean-token-mean`` then gives the paper's mean over sequences.
"""

from __future__ import annotations

import torch

from ..aggregation import agg_loss
from .common import LOG_RATIO_CLAMP, log_ratio, ratio_metrics, seq_mean
from .ppo import check_clip
from .registry import Metrics, ObjectiveInputs, register_objective


@register_objective("gspo", check=check_clip)
def gspo(x: ObjectiveInputs, *, clip_low: float = 0.2, clip_high: float = 0.2) -> tuple[torch.Tensor, Metrics]:
    """GSPO(-token) loss (module doc); metrics as ``ppo_clip``'s, of the sequence ratios, plus ``seq_clipfrac``."""
    lr = log_ratio(x.logp, x.old_logp)
    log_s = torch.clamp(seq_mean(lr, x.mask), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).detach()  # [B]
    s = torch.exp(log_s[:, None] + x.logp - x.logp.detach())  # value s_i on every token, gradient of logp_t
    unclipped = -x.advantages * s
    clipped = -x.advantages * torch.clamp(s, 1.0 - clip_low, 1.0 + clip_high)
    loss = agg_loss(torch.maximum(unclipped, clipped), x.mask, x.agg_mode, normalizer=x.normalizer,
                    horizon=x.horizon)
    active = clipped > unclipped
    metrics = ratio_metrics(s, lr, active, x.mask)
    with torch.no_grad():
        rows = x.mask.bool().any(-1)
        seq_active = (active & x.mask.bool()).any(-1)
        metrics["seq_clipfrac"] = (seq_active & rows).float().sum() / rows.float().sum().clamp_min(1.0)
    return loss, metrics
