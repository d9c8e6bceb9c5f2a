"""A user-defined RL flow on the same machinery as the built-in GRPO: RLOO advantages and a custom reward.

    python examples/custom_workflow.py [KEY=VALUE overrides of configs/grpo_tiny.yaml]

The step function below is all a user writes: plain Python over the role handles of the workflow API.
"""

from __future__ import annotations

import sys

import torch

from rlhf.api import (
    Roles,
    StepContext,
    compute_advantages,
    extract_answer,
    load_config,
    loss_config,
    parse_number,
    prepare_inputs,
    rollout_metrics,
    run_rl,
    token_level_scores,
)


def partial_credit(prompt: object, response: str, ground_truth: str) -> float:
    """1 for the exact sum, 0.2 for a number with the right count of digits, else 0."""
    answer, _ = extract_answer(response or "")
    got, want = parse_number(answer or ""), parse_number(ground_truth or "")
    if got is None or want is None:
        return 0.0
    if got == want:
        return 1.0
    return 0.2 if len(str(abs(int(got)))) == len(str(abs(int(want)))) else 0.0


def rloo_step(roles: Roles, ctx: StepContext) -> dict[str, float]:
    with ctx.phase("generate"):
        batch = roles.rollout.generate(ctx.prompts, seed=ctx.sample_seed())
    with ctx.phase("reward"):
        batch["scores"] = torch.tensor([partial_credit(p, r, g) for p, r, g in
                                        zip(batch["prompt"], batch["response_text"], batch["ground_truth"])])
    with ctx.phase("old_logprobs"):
        batch = roles.policy.logprobs(batch, key="old_logprobs")
    with ctx.phase("advantages"):
        batch["advantages"], batch["returns"] = compute_advantages(
            "rloo", token_level_rewards=token_level_scores(batch), response_mask=batch["response_mask"].float(),
            group_ids=batch["group_id"])
    with ctx.phase("train"):
        metrics = roles.policy.train(batch, loss_config(ctx.cfg))
    with ctx.phase("sync"):
        roles.rollout.sync_weights(roles.policy)
    return {**rollout_metrics(batch), **metrics}


if __name__ == "__main__":
    cfg = load_config("configs/grpo_tiny.yaml", ["trainer.output_dir=runs/custom_rloo", *sys.argv[1:]])
    run_rl(prepare_inputs(cfg), step_fn=rloo_step)
