"""Turn scored rollouts into training targets: KL (in the reward or as a loss) and advantages by name."""

from __future__ import annotations

import torch

from algorithms import (
    apply_kl_penalty,
    compute_advantages,
    distill_advantages,
    kl_estimate,
    masked_mean,
    overlong_keep,
    overlong_penalty,
)
from rlhf.config.schema import AlgorithmConfig
from workers.batch import Batch


def token_level_scores(batch: Batch, scores: torch.Tensor | None = None) -> torch.Tensor:
    """Sequence scores (`scores` [B], default the batch's) placed on the last response token: [B, R]. The
    last token the mask covers, not the mask's count: a multi-turn trajectory's mask has holes where tool
    results and template glue sit."""
    mask = batch["response_mask"]
    out = torch.zeros(mask.shape, dtype=torch.float32)
    cols = torch.arange(mask.shape[1])
    last = torch.where(mask.bool(), cols, -1).max(-1).values.clamp(min=0)
    out[torch.arange(mask.shape[0]), last] = (batch["scores"] if scores is None else scores).float()
    return out * mask


def overlong_shaped_scores(batch: Batch, algo: AlgorithmConfig,
                           max_tokens: int | None) -> tuple[torch.Tensor, dict[str, float]]:
    """The scores with DAPO's overlong penalty (algorithm.overlong_buffer > 0 and `max_tokens` given; the
    length is the response's mask-1 tokens) and its `overlong/penalty_mean`; the batch's scores stay as they
    are (reward metrics are the task's)."""
    scores = batch["scores"].float()
    if algo.overlong_buffer <= 0 or not max_tokens:
        return scores, {}
    pen = overlong_penalty(batch["response_mask"].sum(-1), max_tokens, algo.overlong_buffer,
                           algo.overlong_penalty_factor)
    return scores + pen, {"overlong/penalty_mean": float(pen.mean())}


def filter_overlong(batch: Batch, algo: AlgorithmConfig) -> dict[str, float]:
    """algorithm.overlong_filter: the responses cut at the length limit (`finish_reason` "length") leave the
    loss (their response mask is zeroed); `overlong/filtered_fraction`."""
    if not algo.overlong_filter or "finish_reason" not in batch:
        return {}
    truncated = torch.tensor([r == "length" for r in batch["finish_reason"]], dtype=torch.bool)
    batch["response_mask"] = overlong_keep(batch["response_mask"], truncated)
    return {"overlong/filtered_fraction": float(truncated.float().mean()) if len(truncated) else 0.0}


def add_advantages(batch: Batch, algo: AlgorithmConfig, kl_coef: float,
                   max_tokens: int | None = None) -> tuple[Batch, dict[str, float]]:
    """Add `token_level_rewards`, `advantages` and `returns` [B, R] to the batch; return KL metrics. With
    `max_tokens` (rollout.max_tokens) the rewards carry DAPO's overlong penalty; overlong filtering narrows
    the response mask after the advantages (a filtered sample still counts in its group's baseline). With a
    teacher's `teacher_logprobs` (on-policy distillation) the advantages are `algorithms.distill_advantages`
    of the task's."""
    mask = batch["response_mask"].float()
    scores, metrics = overlong_shaped_scores(batch, algo, max_tokens)
    rewards = token_level_scores(batch, scores)
    metrics["kl"] = 0.0  # no reference: the policy is not regularised towards one
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
    if "teacher_logprobs" in batch:  # on-policy distillation: the per-token reverse KL to the teacher
        student = batch["old_logprobs"] if "old_logprobs" in batch else batch["rollout_logprobs"]
        adv, distilled = distill_advantages(adv, student, batch["teacher_logprobs"], mask, algo.distill.kl_coef,
                                            algo.distill.reward_weight, algo.distill.baseline)
        metrics.update(distilled)
    batch["token_level_rewards"], batch["advantages"], batch["returns"] = rewards, adv, ret
    metrics["advantage_abs_mean"] = float(masked_mean(adv.abs(), mask))
    metrics.update(filter_overlong(batch, algo))
    return batch, metrics  # the off-policy correction is the update's (algorithms/objectives/behaviour.py)

