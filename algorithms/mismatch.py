"""Training-inference mismatch: how far the rollout engine's sampled-token log-probabilities are from the
policy's own (recomputed) ones for the same tokens.

Both come from the same weights, so in exact arithmetic they are equal; what remains is the engines'
numerical difference (kernels, dtype, fused ops) and, for MoE models, tokens routed to different experts.
A large value means the samples are off-policy for the trainer even when the algorithm assumes they are
not (see Yao et al., "Your efficient RL framework secretly brings you off-policy RL training", 2025).
"""

from __future__ import annotations

import torch

from .kl import kl_estimate
from .masked import masked_mean

__all__ = ["logprob_mismatch"]


def logprob_mismatch(rollout_logp: torch.Tensor, policy_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mismatch metrics over the tokens where ``mask`` is 1 (response tokens), all [B, T]:

    - ``logprob_abs_diff_mean`` / ``logprob_abs_diff_max``: mean / max of ``|policy_logp - rollout_logp|``;
    - ``kl``: the k3 estimate of KL(rollout || policy), averaged over the tokens (the tokens were sampled
      by the rollout engine, so it is the "policy" side of ``kl_estimate``; always >= 0).

    An empty mask gives zeros. Returned as Python floats (metrics, no gradient).
    """
    rollout_logp, policy_logp = rollout_logp.detach().float(), policy_logp.detach().float()
    m = mask.bool()
    diff = (policy_logp - rollout_logp).abs()
    kl = kl_estimate(rollout_logp, policy_logp, "k3")
    return {
        "logprob_abs_diff_mean": float(masked_mean(diff, m)),
        "logprob_abs_diff_max": float(diff[m].max()) if m.any() else 0.0,
        "kl": float(masked_mean(kl, m)),
    }
