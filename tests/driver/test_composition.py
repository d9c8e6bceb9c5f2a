"""Every rollout schedule with every kind of rollout and model: a cell runs, or the config check refuses it
before any worker starts, in one line that says why.

Axes: the schedule (sync, one_step_off, async with partial rollouts) x what is generated (single turn, tool
calls, an environment) x the model (dense, MoE with routing replay), plus image prompts with each schedule.
The fast test pins every cell's verdict at config time, so a refusal that appears, goes away or changes its
reason fails here; the `slow` one runs every accepted cell for 2 steps on tiny models (make test-slow; the
features' own end-to-end tests in make test cover one cell each)."""

from __future__ import annotations

import pytest

from rlhf.config import load_config
from rlhf.errors import ConfigError
from tests.helpers.cli import FAST
from tests.helpers.cli import rlhf_in_process as rlhf
from tests.helpers.runs import metrics

SCHEDULES = {
    "sync": ["rollout.mode=sync"],
    "one_step_off": ["rollout.mode=one_step_off"],
    "async": ["rollout.mode=async", "rollout.partial_tokens=2", "rollout.max_staleness=1"],
}
ROLLOUTS = {
    "single": [],
    "tools": ["rollout.tools=[calculator]", "rollout.max_tokens=16"],
    "env": ["rollout.env=workers.agent.env:GuessNumber", "rollout.max_tokens=16"],
}
MODELS = {
    "dense": ["model.preset=tiny-qwen2"],
    "moe": ["model.preset=tiny-qwen2-moe", "policy.moe.routing_replay=true", "algorithm.old_logprobs=recompute"],
}
# The refused cells and a phrase of their reason. Multi-turn trajectories run whole inside one engine call
# (their tool calls and environment steps between the turns), so the async buffer cannot cut them at a sync;
# and the engine records routes for single-turn generations only.
MULTI_TURN_ASYNC = "run whole trajectories per call"
MULTI_TURN_ROUTES = "records no routing for multi-turn"
REFUSED = {
    **{(s, r, "moe"): MULTI_TURN_ROUTES for s in SCHEDULES for r in ("tools", "env")},
    ("async", "tools", "dense"): MULTI_TURN_ASYNC,
    ("async", "env", "dense"): MULTI_TURN_ASYNC,
}
CELLS = [(s, r, m) for s in SCHEDULES for r in ROLLOUTS for m in MODELS]
IMAGES = {"sync": None, "one_step_off": None, "async": "image prompts"}  # schedule -> refusal phrase


def overrides(schedule: str, rollout: str, model: str) -> list[str]:
    return [*FAST, *SCHEDULES[schedule], *ROLLOUTS[rollout], *MODELS[model], "trainer.total_steps=2",
            "trainer.save_every=0"]


def verdict(config: str, args: list[str]) -> str | None:
    """None when the config check accepts the run, else its one-line refusal."""
    try:
        load_config(config, args)
    except ConfigError as e:
        assert "\n" not in str(e), str(e)
        return str(e)
    return None


@pytest.mark.parametrize("cell", CELLS, ids=["-".join(c) for c in CELLS])
def test_each_cell_runs_or_is_refused_with_its_reason(cell, tmp_path):
    got = verdict("configs/grpo_tiny.yaml", [*overrides(*cell), f"trainer.output_dir={tmp_path}"])
    want = REFUSED.get(cell)
    if want is None:
        assert got is None, got
    else:
        assert got is not None and want in got, got


@pytest.mark.parametrize("schedule", list(IMAGES))
def test_image_prompts_with_each_schedule(schedule, tmp_path):
    got = verdict("configs/grpo_shapes_vl.yaml", [*SCHEDULES[schedule], f"trainer.output_dir={tmp_path}"])
    want = IMAGES[schedule]
    if want is None:
        assert got is None, got
    else:
        assert got is not None and want in got, got


RUNS = [c for c in CELLS if c not in REFUSED]


@pytest.mark.slow
@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("cell", RUNS, ids=["-".join(c) for c in RUNS])
def test_each_accepted_cell_trains_two_steps(cell, tmp_path):
    schedule, rollout, model = cell
    run = tmp_path / "run"
    r = rlhf("train", "configs/grpo_tiny.yaml", *overrides(*cell), f"trainer.output_dir={run}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    rows = [row for row in metrics(run) if row["step"] > 0]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert "policy_loss" in row and row["batch_size"] > 0, row
        assert row["rollout/version_lag_max"] <= (0 if schedule == "sync" else 1), row
        if rollout != "single":
            assert row["agent/turns_mean"] >= 1, row
        if model == "moe":  # the replayed routes are the engine's, token for token
            assert row["mismatch/routing_disagreement_max"] == 0.0, row
