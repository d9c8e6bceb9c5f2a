"""KTO (Ethayarajh et al. 2024): a preference loss on unpaired desirable / undesirable answers.

Inputs are one value per example: the policy's and the reference's summed answer log-probs, so each example's
log-ratio is ``r = logps - ref_logps``. The reference point is the KL baseline ``z0``: the mean policy-minus-
reference log-ratio over mismatched pairs (each prompt with another example's answer), clamped at 0 and
detached (no gradient flows through it; the paper's estimate of KL(policy || reference)). Per example:

- desirable:   ``desirable_weight * (1 - sigmoid(beta * (r - z0)))``
- undesirable: ``undesirable_weight * (1 - sigmoid(beta * (z0 - r)))``

The weights (the paper's lambda_D, lambda_U) balance the two kinds when their counts differ; the paper keeps
``lambda_D n_D / (lambda_U n_U)`` in [1, 4/3]. Losses are returned per example for the caller to reduce
(divide the sum by the global example count). The DPO stage trains it as ``algorithm.dpo.loss=kto``
(``preference_loss``), each pair split into a desirable and an undesirable example, z0 from each prompt with
the next pair's chosen answer (``rlhf/data/kto_examples.py``).
"""

from __future__ import annotations

import torch

__all__ = ["kto_kl_baseline", "kto_loss"]


def kto_kl_baseline(mismatched_logps: torch.Tensor, mismatched_ref_logps: torch.Tensor) -> torch.Tensor:
    """z0: the mean of ``mismatched_logps - mismatched_ref_logps`` [N], clamped at 0, detached (a scalar).
    Under data parallelism average over all ranks' mismatched pairs before the clamp."""
    if mismatched_logps.numel() == 0:
        return mismatched_logps.new_zeros(())
    return (mismatched_logps - mismatched_ref_logps).mean().clamp(min=0.0).detach()


def kto_loss(
    desirable_logps: torch.Tensor,
    desirable_ref_logps: torch.Tensor,
    undesirable_logps: torch.Tensor,
    undesirable_ref_logps: torch.Tensor,
    kl_baseline: torch.Tensor,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(loss of each desirable example [Bd], of each undesirable example [Bu], metrics) as in the module
    docstring; ``kl_baseline`` is z0 (`kto_kl_baseline`), used detached.

    Metrics, detached: ``rewards/desirable`` [Bd] and ``rewards/undesirable`` [Bu] (``beta * r``) and
    ``kl_baseline`` (z0, a scalar)."""
    z0 = kl_baseline.detach()
    r_d = desirable_logps - desirable_ref_logps
    r_u = undesirable_logps - undesirable_ref_logps
    loss_d = desirable_weight * (1.0 - torch.sigmoid(beta * (r_d - z0)))
    loss_u = undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - r_u)))
    metrics = {"rewards/desirable": (beta * r_d).detach(), "rewards/undesirable": (beta * r_u).detach(),
               "kl_baseline": z0}
    return loss_d, loss_u, metrics
