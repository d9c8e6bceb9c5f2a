"""On the real stack: a `module:function` reward from the config (a module of the user's on PYTHONPATH) scores
the samples; when it misbehaves (raises, returns a string or NaN, hangs) the sample is scored by the fallback
and counted in metrics.jsonl instead of crashing or hanging the run, and a run whose every policy update is
skipped (NaN advantages) stops with policy.optim.max_consecutive_nonfinite instead of exit 0."""

from __future__ import annotations

import os

import pytest

from tests.helpers.cli import FAST, python
from tests.helpers.runs import metrics

USER_REWARD = '''
import math, os, time
calls = 0

def flaky(prompt, response, ground_truth):
    global calls
    calls += 1
    marker = os.path.join(os.path.dirname(__file__), "slept")
    if not os.path.exists(marker):  # the very first call hangs: reward.timeout_s ends it, a new process takes over
        open(marker, "w").close()
        time.sleep(3600)
    if calls == 2:
        raise RuntimeError("flaky")
    if calls == 3:
        return "not a number"
    if calls == 4:
        return math.nan
    return 1.0
'''

STEP = '''
import sys
import torch
from rlhf.api import load_config, loss_config, prepare_inputs, run_rl
from rlhf.errors import UserError


def nan_step(roles, ctx):
    batch = roles.rollout.generate(ctx.prompts, seed=ctx.sample_seed())
    batch = roles.reward(batch)
    batch = roles.policy.logprobs(batch, key="old_logprobs")
    batch["advantages"] = torch.full_like(batch["old_logprobs"], float("nan"))
    batch["returns"] = batch["advantages"]
    return {**roles.policy.train(batch, loss_config(ctx.cfg)), "reward_mean": float(batch["scores"].mean())}


if __name__ == "__main__":
    try:
        run_rl(prepare_inputs(load_config("configs/grpo_tiny.yaml", sys.argv[1:])), step_fn=nan_step)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
'''


# `slow` (62 s in make test): the reward guard's counting and fallback are checked without a run in
# test_reward_guard.py, the stop after skipped updates in test_run_loop_guard.py
@pytest.mark.slow
def test_flaky_reward_is_counted_and_skipped_updates_stop_the_run(tmp_path):
    (tmp_path / "flaky_reward.py").write_text(USER_REWARD)
    (tmp_path / "nan_step.py").write_text(STEP)
    run = tmp_path / "run"
    r = python(str(tmp_path / "nan_step.py"), *FAST, "reward.fn=flaky_reward:flaky",
               "reward.timeout_s=2", "reward.num_workers=1", "reward.fallback_score=0.5",
               "policy.optim.max_consecutive_nonfinite=2", "trainer.total_steps=6", "trainer.val_every=0",
               "data.val_size=4", "trainer.export_hf=false", f"trainer.output_dir={run}",
               timeout=900, path=tmp_path, cwd=os.getcwd())
    assert r.returncode == 2, r.stderr[-4000:]
    last = r.stderr.strip().splitlines()[-1]
    assert "stopped at step 2" in last and "policy.optim.max_consecutive_nonfinite=2" in last, r.stderr[-3000:]
    rows = {row["step"]: row for row in metrics(run)}
    assert sorted(rows) == [0, 1, 2]  # validation at step 0 (first calls), then two skipped updates
    counted = [(row["reward/errors"], row["reward/timeouts"]) for row in rows.values()]
    assert sum(e for e, _ in counted) >= 3 and sum(t for _, t in counted) >= 1, counted
    assert rows[1]["skipped_steps"] == rows[1]["num_steps"] >= 1
    assert rows[2]["reward_mean"] == 1.0  # past its first four calls the user's function scores every sample
    warnings = [x for x in r.stderr.splitlines() if x.startswith("warning: ")]
    assert warnings and all("reward.fn flaky_reward:flaky" in x and "on sample" in x for x in warnings), warnings
    assert "flaky_reward:flaky took longer than reward.timeout_s=2 on sample 0" in warnings[0], warnings
