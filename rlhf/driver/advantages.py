"""Turn scored rollouts into training targets: KL (in the reward or as a loss) and advantages by name."""

from __future__ import annotations

import torch

from algorithms import apply_kl_penalty, compute_advantages, kl_estimate, masked_mean, rollout_correction
from rlhf.config.schema import AlgorithmConfig
from workers.batch import Batch


def token_level_scores(batch: Batch) -> torch.Tensor:
    """Sequence scores placed on the last response token: [B, R]. The last token the mask covers, not the
    mask's count: a multi-turn trajectory's mask has holes where tool results and template glue sit."""
    mask = batch["response_mask"]
    out = torch.zeros(mask.shape, dtype=torch.float32)
    cols = torch.arange(mask.shape[1])
    last = torch.where(mask.bool(), cols, -1).max(-1).values.clamp(min=0)
    out[torch.arange(mask.shape[0]), last] = batch["scores"].float()
    return out * mask


def add_advantages(batch: Batch, algo: AlgorithmConfig, kl_coef: float) -> tuple[Batch, dict[str, float]]:
    """Add `token_level_rewards`, `advantages` and `returns` [B, R] to the batch; return KL metrics."""
    mask = batch["response_mask"].float()
    rewards = token_level_scores(batch)
    metrics: dict[str, float] = {"kl": 0.0}  # no reference: the policy is not regularised towards one
    if "ref_logprobs" in batch:
        old = batch["old_logprobs"] if "old_logprobs" in batch else batch["rollout_logprobs"]  # in_update: the engine's
        kl = kl_estimate(old, batch["ref_logprobs"], algo.kl_kind)
        metrics["kl"] = float(masked_mean(kl, mask))
        if algo.kl_in_reward and kl_coef > 0:
            rewards, _ = apply_kl_penalty(rewards, kl, kl_coef, mask)
    group_ids = torch.as_tensor(batch["group_id"], dtype=torch.long)
    adv, ret = compute_advantages(
        algo.adv_estimator,
        token_level_rewards=rewards,
        response_mask=mask,
        values=batch["values"] if "values" in batch else None,  # noqa: SIM401 - a Batch has no .get
        group_ids=group_ids,
        gamma=algo.gamma,
        lam=algo.lam,
        norm_by_std=algo.norm_by_std,
    )
    batch["token_level_rewards"], batch["advantages"], batch["returns"] = rewards, adv, ret
    metrics["advantage_abs_mean"] = float(masked_mean(adv.abs(), mask))
    if algo.off_policy_correction != "none" and algo.old_logprobs != "in_update":  # in_update: in the update
        metrics.update(correct_off_policy(batch, algo))
    return batch, metrics


def correct_off_policy(batch: Batch, algo: AlgorithmConfig) -> dict[str, float]:
    """algorithm.off_policy_correction (algorithms/off_policy.py): the advantages weighted and the response
    mask narrowed by the ratio of the recomputed old log-probs to the engine's; `off_policy/*` metrics."""
    weights, keep, metrics = rollout_correction(batch["old_logprobs"], batch["rollout_logprobs"],
                                                batch["response_mask"], algo.off_policy_correction,
                                                cap=algo.is_cap, low=algo.is_low, high=algo.is_high)
    batch["advantages"] = batch["advantages"] * weights
    batch["response_mask"] = keep
    return {f"off_policy/{k}": v for k, v in metrics.items()}
