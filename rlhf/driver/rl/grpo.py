"""The built-in GRPO step, written with the workflow API. It reads like the algorithm."""

from __future__ import annotations

import math

import torch

from algorithms.mismatch import routing_disagreement, routing_disagreement_metrics
from rlhf.config import RunConfig
from rlhf.driver.rl.advantages import add_advantages
from rlhf.driver.rl.context import StepContext, rollout_metrics
from rlhf.workflow import Roles, loss_config
from workers.batch import Batch
from workers.roles.routes import POLICY_ROUTES_KEY, ROUTES_KEY
from workers.rollout.prompts import concat_rollouts
from workers.rollout.syncer import SYNC_METRICS


def informative_groups(batch: Batch) -> Batch:
    """Dynamic sampling (DAPO): keep only the groups whose rewards are not all equal."""
    gid = torch.as_tensor(batch["group_id"])
    scores = batch["scores"].float()
    keep = torch.zeros(len(batch), dtype=torch.bool)
    for g in gid.unique():
        rows = gid == g
        keep |= rows & (scores[rows].max() > scores[rows].min())
    return batch.index(keep)


def generate_and_score(roles: Roles, ctx: StepContext) -> Batch:
    """Sample n responses per prompt and score them; with dynamic sampling, refill dropped groups."""
    cfg = ctx.cfg
    score = ctx.timed("reward", roles.reward)  # time/reward: within time/generate when streamed
    with ctx.phase("generate"):
        # the run's schedule (sync, one_step_off, async) gives the samples; each engine's are scored as they
        # return (async: the buffer scores groups as they finish)
        if ctx.source is not None:
            batch = ctx.source.generate(ctx, score)
            ctx.metrics.update(ctx.source.pop_metrics())  # async: the buffer's stale drops and partial samples
        else:
            batch = roles.rollout.generate(ctx.prompts, score=score, seed=ctx.sample_seed())
    lag = [roles.rollout.version - v for v in batch["policy_version"]]
    ctx.metrics["rollout/version_lag_mean"] = sum(lag) / max(len(lag), 1)
    ctx.metrics["rollout/version_lag_max"] = float(max(lag, default=0))
    if "scores" not in batch:  # a custom rollout that does not score
        with ctx.phase("reward"):
            batch = roles.reward(batch)
    if "rollout/scored_while_generating" in batch.info:
        ctx.metrics["rollout/scored_while_generating"] = float(batch.info["rollout/scored_while_generating"])
    if not cfg.algorithm.dynamic_sampling:
        return batch
    wanted, kept, rounds, drawn = len(batch), informative_groups(batch), 0, 0
    for _ in range(cfg.algorithm.max_resample_rounds):
        if len(kept) >= wanted:
            break
        missing = math.ceil((wanted - len(kept)) / cfg.rollout.n)  # groups still to find
        count = math.ceil(missing * cfg.algorithm.oversample_factor)
        with ctx.phase("generate"):
            extra = roles.rollout.generate(ctx.next_prompts(count), score=score, seed=ctx.sample_seed())
        rounds, drawn = rounds + 1, drawn + count
        extra["group_id"] = [g + 10**6 * (ctx.resample_round()) for g in extra["group_id"]]
        kept = concat_rollouts([kept, informative_groups(extra)])
    kept = whole_groups_dividing(kept.index(slice(0, wanted)), train_divisor(cfg))
    ctx.metrics["dynamic_sampling/kept_fraction"] = len(kept) / wanted
    ctx.metrics["dynamic_sampling/rounds"] = float(rounds)
    ctx.metrics["dynamic_sampling/extra_prompts"] = float(drawn)
    # Train on whole groups only, at most the configured batch size; fall back to the full batch if none fit.
    return kept if len(kept) else batch


def train_divisor(cfg: RunConfig) -> int:
    """What a training batch's size must divide by: algorithm.mini_batches x the DP size of every trained
    role (their least common multiple), as the mini-batch split requires (`workers.dispatch`)."""
    dps = [cfg.policy.parallel.dp] + ([cfg.critic.parallel.dp] if cfg.critic.enabled else [])
    return max(1, cfg.algorithm.mini_batches) * math.lcm(*dps)


def whole_groups_dividing(batch: Batch, divisor: int) -> Batch:
    """The longest prefix of `batch` made of whole groups (rows of one `group_id` are contiguous) whose
    size divides by `divisor`; empty if none does. Dynamic sampling keeps a varying number of groups, and a
    batch that does not split into mini-batches x DP would fail in the train step."""
    gid = list(batch["group_id"]) if len(batch) else []
    ends = [i + 1 for i in range(len(gid)) if i + 1 == len(gid) or gid[i + 1] != gid[i]]
    size = next((e for e in reversed(ends) if e % divisor == 0), 0)
    return batch.index(slice(0, size))


def add_logprobs(roles: Roles, batch: Batch, ctx: StepContext) -> Batch:
    """The reference's logprobs (when there is one), a distillation teacher's (and its greedy picks), and the
    behaviour policy's: recomputed by the policy, the
    engine's sampled-token logprobs, or none yet (`in_update`: the policy's update takes its own). The update
    compares them with the engine's (`mismatch/*`) and applies the off-policy correction
    (algorithms/objectives/behaviour.py); a recomputing pass also logs the MoE routing mismatch here."""
    if roles.reference is not None:
        with ctx.phase("reference"):
            batch = roles.reference.logprobs(batch, key="ref_logprobs")
    if roles.teacher is not None:  # on-policy distillation: the teacher scores the student's own tokens
        with ctx.phase("teacher"):
            batch = roles.teacher.logprobs(batch, key="teacher_logprobs", top1="teacher_top1")
    if ctx.cfg.algorithm.old_logprobs == "rollout":
        batch["old_logprobs"] = batch["rollout_logprobs"]
        return batch
    if ctx.cfg.algorithm.old_logprobs == "in_update":  # the policy's update takes them (and logs `mismatch/*`)
        return batch
    with ctx.phase("old_logprobs"):
        batch = roles.policy.logprobs(batch, key="old_logprobs")
    ctx.metrics.update(routing_mismatch_metrics(batch))
    return batch


def routing_mismatch_metrics(batch: Batch) -> dict[str, float]:
    """`mismatch/routing_disagreement*` of MoE models whose engine recorded its routing: per layer the fraction
    of tokens (prompt and response) whose top-k experts differ between the engine and the policy's recomputing
    forward (0 with routing replay); the policy's routes are dropped from the batch afterwards. Empty
    otherwise. (The log-prob mismatch is the update's: algorithms/objectives/behaviour.py.)"""
    if ROUTES_KEY not in batch or POLICY_ROUTES_KEY not in batch:
        return {}
    policy_routes = batch.tensors.pop(POLICY_ROUTES_KEY)
    out = routing_disagreement_metrics(*routing_disagreement(batch[ROUTES_KEY], policy_routes, batch["attention_mask"]))
    return {f"mismatch/{k}": v for k, v in out.items()}


def grpo_step(roles: Roles, ctx: StepContext) -> dict[str, float]:
    cfg = ctx.cfg
    batch = generate_and_score(roles, ctx)
    roles.rollout.sleep()  # colocated engines free their memory for the policy's turn; the sync wakes them
    batch = add_logprobs(roles, batch, ctx)
    with ctx.phase("advantages"):
        batch, adv_metrics = add_advantages(batch, cfg.algorithm, ctx.kl_ctrl.value, cfg.rollout.max_tokens)
    with ctx.phase("train"):
        train_metrics = roles.policy.train(batch, loss_config(cfg))
    with ctx.phase("sync"):
        synced = roles.rollout.sync_weights(roles.policy)
    ctx.kl_ctrl.update(adv_metrics.get("kl", 0.0), len(batch))
    return {**rollout_metrics(batch), **adv_metrics, **train_metrics, "policy_loss": train_metrics.get("pg_loss", 0.0),
            "kl_coef": ctx.kl_ctrl.value,
            "sync/bytes": synced["sync/bytes"], **{k: synced[k] for k in SYNC_METRICS if k in synced}}
