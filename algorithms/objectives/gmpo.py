"""``gmpo``: Geometric-Mean Policy Optimization (Zhao et al. 2025).

GRPO's arithmetic mean of token ratios becomes a geometric mean, whose outlier ratios move the objective
less, with each token's ratio clipped in log space. Per sequence, with ``A_i`` its advantage (the masked mean
of its token advantages), ``sgn = sign(A_i)`` and ``lr_t = logp_t - old_logp_t``::

    g_t = sgn * min(sgn * lr_t, sgn * clip(lr_t, -clip_low, clip_high))
    l_i = -A_i * exp(mean_t g_t)          # = -sgn * prod_t min(r_t A_i, clip(r_t, e^-lo, e^hi) A_i)^(1/|o_i|)

``clip_low`` / ``clip_high`` bound the log-ratio (the paper: 0.4 each, ratios in [e^-0.4, e^0.4]). ``l_i`` is
put on every token of its row and reduced with ``loss_agg_mode``; ``seq-mean-token-mean`` is the paper's mean
over sequences.
"""

from __future__ import annotations

import torch

from ..aggregation import agg_loss
from .common import log_ratio, ratio_metrics, seq_mean
from .registry import Metrics, ObjectiveInputs, register_objective


def check_log_clip(clip_low: float = 0.4, clip_high: float = 0.4) -> None:
    """Log-space clip bounds: both >= 0."""
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high (log-ratio bounds) must be >= 0, got {clip_low}, {clip_high}")


@register_objective("gmpo", check=check_log_clip)
def gmpo(x: ObjectiveInputs, *, clip_low: float = 0.4, clip_high: float = 0.4) -> tuple[torch.Tensor, Metrics]:
    """GMPO loss (module doc); metrics as ``ppo_clip``'s over the token ratios, ``clipfrac`` of the log clip, and
    ``seq_ratio_mean``: the sequences' clipped geometric-mean ratio ``exp(mean_t g_t)``, averaged."""
    lr = log_ratio(x.logp, x.old_logp)
    adv = seq_mean(x.advantages, x.mask)  # [B]
    sgn = torch.sign(adv)[:, None]
    g = sgn * torch.minimum(sgn * lr, sgn * torch.clamp(lr, -clip_low, clip_high))
    geo = torch.exp(seq_mean(g, x.mask))  # [B]
    per_seq = -adv * geo
    loss = agg_loss(per_seq[:, None].expand_as(lr), x.mask, x.agg_mode, normalizer=x.normalizer,
                    horizon=x.horizon)
    metrics = ratio_metrics(torch.exp(lr), lr, g != lr, x.mask)
    with torch.no_grad():
        rows = x.mask.bool().any(-1).to(geo.dtype)
        metrics["seq_ratio_mean"] = (geo.detach() * rows).sum() / rows.sum().clamp_min(1.0)
    return loss, metrics
