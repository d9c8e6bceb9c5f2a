"""The RL run's non-finite guard without a run: a step counts when every optimizer step of its policy update
was skipped (NaN/Inf gradient norm); `policy.optim.max_consecutive_nonfinite` such steps in a row stop the run
with a message naming the setting, a good step resets the count, and a resumed count carries on.
(The whole run that trips it: tests/driver/test_reward_guard_e2e.py, `slow`.)"""

from __future__ import annotations

import pytest

from rlhf.config import load_config
from rlhf.driver.infra.run_loop import NonFiniteGuard
from rlhf.driver.rl.runner import nonfinite_guard
from rlhf.errors import NonFiniteError

SKIPPED = {"num_steps": 2.0, "skipped_steps": 2.0}
HALF = {"num_steps": 2.0, "skipped_steps": 1.0}
GOOD = {"num_steps": 2.0, "skipped_steps": 0.0}


def _guard(limit: int) -> NonFiniteGuard:
    cfg = load_config("configs/grpo_tiny.yaml", [f"policy.optim.max_consecutive_nonfinite={limit}"])
    return nonfinite_guard(cfg)


def test_the_limit_of_wholly_skipped_updates_in_a_row_stops_the_run():
    guard = _guard(2)
    assert guard.record(SKIPPED) == 1
    guard.check(1)
    assert guard.record(SKIPPED) == 2
    with pytest.raises(NonFiniteError) as err:
        guard.check(2)
    msg = str(err.value)
    assert msg.startswith("stopped at step 2: the policy update of 2 steps in a row was skipped")
    assert "policy.optim.max_consecutive_nonfinite=2" in msg and "resume from the last checkpoint" in msg


def test_a_partly_skipped_or_good_update_resets_the_count():
    guard = _guard(2)
    guard.record(SKIPPED)
    assert guard.record(HALF) == 0  # one optimizer step of the update went through
    guard.record(SKIPPED)
    assert guard.record(GOOD) == 0
    assert guard.record({}) == 0  # a step without an update (all groups dropped) is no skipped update
    guard.check(5)


def test_a_resumed_count_carries_on():
    guard = _guard(3)
    guard.count = 2  # as RunLoop.restore sets it from the checkpoint's driver state
    guard.record(SKIPPED)
    with pytest.raises(NonFiniteError):
        guard.check(7)
