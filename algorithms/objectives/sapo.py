"""``sapo``: Soft Adaptive Policy Optimization (Gao et al., Qwen, 2025).

A smooth gate replaces the hard clip: the token's surrogate is ``f(r) * A`` with::

    f(r) = sigmoid(tau * (r - 1)) * 4 / tau,   tau = sapo_tau_pos if A > 0 else sapo_tau_neg
    l_t  = -f(r_t) * A_t,                       r_t = exp(logp_t - old_logp_t)

``d f / d logp = 4 sigmoid(z) (1 - sigmoid(z)) * r`` with ``z = tau (r - 1)``: at r = 1 exactly the policy
gradient's weight, decaying smoothly as r leaves 1 (faster for larger tau). The paper takes
``tau_neg > tau_pos`` (1.05 and 1.0), damping negative-advantage tokens sooner, and the
``seq-mean-token-mean`` reduction.
"""

from __future__ import annotations

import torch

from ..aggregation import agg_loss
from ..masked import masked_mean
from .common import log_ratio, ratio_metrics
from .registry import Metrics, ObjectiveInputs, register_objective


def check_tau(sapo_tau_pos: float = 1.0, sapo_tau_neg: float = 1.05) -> None:
    """Both gate temperatures > 0."""
    if not (sapo_tau_pos > 0 and sapo_tau_neg > 0):
        raise ValueError(f"sapo_tau_pos and sapo_tau_neg must be > 0, got {sapo_tau_pos}, {sapo_tau_neg}")


@register_objective("sapo", check=check_tau)
def sapo(x: ObjectiveInputs, *, sapo_tau_pos: float = 1.0,
         sapo_tau_neg: float = 1.05) -> tuple[torch.Tensor, Metrics]:
    """SAPO loss (module doc). ``gate_weight_mean``: mean of ``4 sigmoid(z)(1 - sigmoid(z))``, the gradient's
    damping; ``clipfrac``: tokens damped below half."""
    lr = log_ratio(x.logp, x.old_logp)
    r = torch.exp(lr)
    tau = torch.where(x.advantages > 0, r.new_tensor(sapo_tau_pos), r.new_tensor(sapo_tau_neg))
    sig = torch.sigmoid(tau * (r - 1.0))
    loss = agg_loss(-sig * 4.0 / tau * x.advantages, x.mask, x.agg_mode, normalizer=x.normalizer,
                    horizon=x.horizon)
    weight = (4.0 * sig * (1.0 - sig)).detach()
    metrics = ratio_metrics(r, lr, weight < 0.5, x.mask)
    metrics["gate_weight_mean"] = masked_mean(weight, x.mask)
    return loss, metrics
