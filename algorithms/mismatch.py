"""Training-inference mismatch: how far the rollout engine's sampled-token log-probabilities are from the
policy's own (recomputed) ones for the same tokens.

Both come from the same weights, so in exact arithmetic they are equal; what remains is the engines'
numerical difference (kernels, dtype, fused ops) and, for MoE models, tokens routed to different experts.
For MoE models the routing itself is compared too (`routing_disagreement`): per layer, the fraction of
tokens whose set of top-k experts differs between the rollout engine and the policy's forward.
A large value means the samples are off-policy for the trainer even when the algorithm assumes they are
not (see Yao et al., "Your efficient RL framework secretly brings you off-policy RL training", 2025).
"""

from __future__ import annotations

import torch

from .kl import kl_estimate
from .masked import masked_mean

__all__ = ["logprob_mismatch", "routing_disagreement", "routing_disagreement_metrics"]


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


def routing_disagreement(rollout_experts: torch.Tensor, policy_experts: torch.Tensor,
                         mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer, how many tokens have a different top-k expert SET in the two routings.

    ``rollout_experts`` and ``policy_experts`` are expert ids [..., L, k] (integers; the order within the
    k does not matter, ties in it neither); an id < 0 marks a routing that was not recorded (a dense
    layer, a position the engine never routed), and such a (token, layer) is not counted. ``mask``
    [...] (optional, 0/1) restricts the tokens. Returns ``(differ, counted)``, both float [L]: the tokens
    whose sets differ and the tokens compared, per layer."""
    if rollout_experts.shape != policy_experts.shape:
        raise ValueError(f"routings of different shapes: {tuple(rollout_experts.shape)} vs "
                         f"{tuple(policy_experts.shape)} ([..., layers, top-k])")
    a = rollout_experts.detach().long().sort(-1).values
    b = policy_experts.detach().long().sort(-1).values
    known = (a >= 0).all(-1) & (b >= 0).all(-1)  # [..., L]
    if mask is not None:
        known = known & mask.bool().unsqueeze(-1)
    differ = (a != b).any(-1) & known
    layers = a.shape[-2]
    return differ.reshape(-1, layers).sum(0).double(), known.reshape(-1, layers).sum(0).double()


def routing_disagreement_metrics(differ: torch.Tensor, counted: torch.Tensor) -> dict[str, float]:
    """Metrics from `routing_disagreement`'s counts (summed over batches or ranks if need be), over the
    layers where some token was compared: ``routing_disagreement`` (mean of the per-layer fractions),
    ``routing_disagreement_max`` (the worst layer) and ``routing_disagreement/layer{i}`` (0-based layer
    index). No compared token: {}."""
    layers = (counted > 0).nonzero().flatten().tolist()
    if not layers:
        return {}
    frac = differ / counted.clamp(min=1)
    out = {f"routing_disagreement/layer{i}": float(frac[i]) for i in layers}
    out["routing_disagreement"] = float(frac[layers].mean())
    out["routing_disagreement_max"] = float(frac[layers].max())
    return out
