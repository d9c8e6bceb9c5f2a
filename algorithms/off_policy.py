"""Off-policy correction for samples the trainer did not produce itself: the rollout's behaviour policy
(the engine's weights when it sampled, e.g. one version old in the one-step-off pipeline) differs from the
policy whose log-probs the PPO ratio starts from (``old_logprobs``, recomputed by the trainer).

With ``rho = exp(old_logprobs - rollout_logprobs)`` per response token:

- ``tis``: truncated importance sampling: each token's loss is weighted by ``min(rho, cap)``;
- ``mis_token``: masked importance sampling: tokens whose ``rho`` leaves ``[low, high]`` are dropped;
- ``mis_sequence``: the same for whole sequences, by the geometric mean of their tokens' ``rho``;
- ``none``: no correction.

The weights are constants (no gradient). The caller multiplies the advantages by ``weights`` (equal to
weighting the per-token PPO loss, since the weights are positive) and the response mask by ``keep``.
"""

from __future__ import annotations

import torch

from .masked import masked_mean

__all__ = ["IS_CORRECTIONS", "rollout_correction"]

IS_CORRECTIONS = ("none", "tis", "mis_token", "mis_sequence")


def rollout_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                       kind: str, cap: float = 2.0, low: float = 0.5,
                       high: float = 2.0) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """``(weights, keep, metrics)`` for [B, R] log-probs over the tokens where ``mask`` is 1.

    ``weights`` (float) and ``keep`` (0/1, ``mask``'s dtype) are [B, R]; metrics: ``is_ratio_mean`` /
    ``is_ratio_max`` (rho over the masked tokens), ``capped_fraction`` (tis: tokens with rho > cap) and
    ``masked_fraction`` (mis: tokens dropped), as floats."""
    if kind not in IS_CORRECTIONS:
        raise ValueError(f"unknown off-policy correction {kind!r}; expected one of {', '.join(IS_CORRECTIONS)}")
    m = mask.float()
    log_rho = (old_logprobs.float() - rollout_logprobs.float()).detach() * m
    rho = torch.exp(log_rho)
    weights = torch.ones_like(rho)
    keep = torch.ones_like(m)
    metrics = {"is_ratio_mean": float(masked_mean(rho, m)) if m.sum() else 1.0,
               "is_ratio_max": float(rho[m.bool()].max()) if m.sum() else 1.0,
               "capped_fraction": 0.0, "masked_fraction": 0.0}
    if kind == "tis":
        weights = rho.clamp(max=cap)
        metrics["capped_fraction"] = float(masked_mean((rho > cap).float(), m)) if m.sum() else 0.0
    elif kind == "mis_token":
        keep = ((rho >= low) & (rho <= high)).float()
    elif kind == "mis_sequence":
        seq_rho = torch.exp(log_rho.sum(-1) / m.sum(-1).clamp(min=1))
        keep = ((seq_rho >= low) & (seq_rho <= high)).float()[:, None].expand_as(m)
    if kind.startswith("mis"):
        metrics["masked_fraction"] = float(masked_mean(1.0 - keep, m)) if m.sum() else 0.0
    return weights * m, (keep * m).to(mask.dtype), metrics
