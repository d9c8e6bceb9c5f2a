"""Distillation on the teacher's samples (`algorithm.distill.mode: forward_kl`) end to end on the real stack:
a second vLLM engine serves the teacher, and the student takes an LM step on its samples, 2 steps in-process
on the shared Ray.

The teacher is a short SFT of the task (answers such as `95<eos>`), the student the untrained model: the
student's loss on the teacher's samples starts near log(vocab) and falls as it learns them, while the teacher's
engine is never synced (its samples keep their log-probs) and the student's engine is, each step."""

from __future__ import annotations

import math

import pytest

from tests.helpers.cli import FAST
from tests.helpers.runs import metrics

pytestmark = pytest.mark.usefixtures("ray_session")
STEPS = 2


@pytest.fixture(scope="module")
def rows(tmp_path_factory, tiny_model_factory) -> list[dict]:
    from rlhf.api import load_config, prepare_inputs, run_rl

    tmp = tmp_path_factory.mktemp("distill_forward")
    start = tiny_model_factory("arith-qwen2")
    teacher_run = load_config("configs/grpo_tiny.yaml", [  # only prepared: its warm start is the teacher
        "model.warm_start_steps=60", "model.warm_start_lr=3e-3", "model.warm_start_batch=64", "data.val_size=16",
        f"trainer.output_dir={tmp / 'teacher'}"])
    teacher = prepare_inputs(teacher_run).model.path
    run = tmp / "run"
    cfg = load_config("configs/grpo_tiny.yaml", [
        *FAST, f"trainer.total_steps={STEPS}", "trainer.val_every=0", "trainer.save_every=0",
        "trainer.export_hf=false", "model.warm_start_steps=0", f"model.path={start}", "data.prompts_per_step=4",
        "policy.optim.lr=5e-3", "policy.resources.num_cpus_per_worker=0.5",
        "teacher.enabled=true", f"teacher.model_path={teacher}", "algorithm.distill.mode=forward_kl",
        "reward.num_workers=1", f"trainer.output_dir={run}"])
    run_rl(prepare_inputs(cfg))
    return [row for row in metrics(run) if row["step"] > 0]


def test_the_student_learns_the_teachers_samples(rows):
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    first, last = rows[0]["distill/forward_nll"], rows[-1]["distill/forward_nll"]
    assert math.log(100) < first < 2 * math.log(512), rows  # untrained: near log(vocab) per token
    assert last < 0.95 * first, rows  # measured: 6.18 -> 5.51
    for row in rows:
        assert row["grad_norm"] > 0 and row["skipped_steps"] == 0, row


def test_the_teacher_samples_and_the_student_engine_is_synced(rows):
    for row in rows:
        assert row["teacher/batch_size"] == 4 * 4, row  # prompts_per_step x rollout.n, from the teacher's engine
        assert row["teacher/reward_mean"] >= 0 and row["distill/teacher_logprob_mean"] < 0, row
        assert row["sync/bytes"] > 0 and row["time/sync"] > 0, row
        assert "distill/teacher_kl" not in row  # the on-policy mode's metric: no teacher group scores here
