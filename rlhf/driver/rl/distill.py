"""Distillation on the teacher's samples (`algorithm.distill.mode: forward_kl`, GKD's supervised case).

A second rollout engine serves the teacher (`teacher.model_path`); each step it samples `rollout.n` responses
per prompt, and the student takes one LM step on their response tokens. The student's loss there is
`-E_{y ~ teacher} log p_student(y)`, the sampled forward KL(teacher || student) up to the teacher's entropy,
so it covers the teacher's modes (mass-covering), unlike the reverse KL of on-policy distillation (the default
mode: `algorithms/distill.py`, applied in `rlhf.driver.rl.advantages`). The student's own engine gets the new
weights after each step; validation and evaluation sample from it.
"""

from __future__ import annotations

from algorithms import masked_mean
from rlhf.driver.rl.context import StepContext, rollout_metrics
from rlhf.workflow import Roles
from workers.rollout.syncer import SYNC_METRICS


def forward_kl_step(roles: Roles, ctx: StepContext) -> dict[str, float]:
    assert roles.teacher_rollout is not None, "distill.mode=forward_kl starts the teacher's engines"
    with ctx.phase("generate"):  # the teacher's samples, scored by the task reward (logged, not trained on)
        batch = roles.teacher_rollout.generate(ctx.prompts, score=ctx.timed("reward", roles.reward),
                                               seed=ctx.sample_seed())
    with ctx.phase("train"):
        lm = roles.policy.train_lm(batch)
    with ctx.phase("sync"):
        synced = roles.rollout.sync_weights(roles.policy)
    teacher_logp = masked_mean(batch["rollout_logprobs"].float(), batch["response_mask"].float())
    return {**{f"teacher/{k}": v for k, v in rollout_metrics(batch).items()},
            "distill/forward_nll": lm["loss"], "distill/teacher_logprob_mean": float(teacher_logp),
            "loss": lm["loss"], "grad_norm": lm["grad_norm"], "lr": lm["lr"],
            "num_steps": 1.0, "skipped_steps": lm["skipped"], "sync/bytes": synced["sync/bytes"],
            **{k: synced[k] for k in SYNC_METRICS if k in synced}}
