"""Untrusted `module:function` rewards run in processes with a per-call timeout: an exception, a non-numeric
or non-finite result, a crash or a hang is scored by reward.fallback_score and counted, or stops the run with
one line naming the function and the sample (reward.on_error=fail). Real processes, no mocks."""

from __future__ import annotations

import math

import pytest

from rlhf.config.schema import RewardConfig
from rlhf.driver.rl.rewards import RewardError, RewardScorer

USER_REWARD = '''
import math, os, time

def score(prompt, response, ground_truth):
    print("noise on stdout must not garble the replies")
    if response == "raise":
        raise ValueError("boom")
    if response == "str":
        return "1.0"
    if response == "none":
        return None
    if response == "nan":
        return math.nan
    if response == "sleep":
        time.sleep(3600)
    if response == "exit":
        os._exit(3)
    return float(len(response))
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_reward_mod.py").write_text(USER_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))  # the reward processes get the driver's sys.path
    return "user_reward_mod:score"


def _scorer(spec: str, **kw) -> RewardScorer:
    return RewardScorer(RewardConfig(fn=spec, **kw))


def test_failures_score_the_fallback_and_are_counted(user_module, capfd):
    scorer = _scorer(user_module, fallback_score=-1.0, timeout_s=2.0, num_workers=2)
    responses = ["ab", "raise", "str", "none", "nan", "sleep", "exit", "abcd", "abc"]
    try:
        scores = scorer.score(["p"] * len(responses), responses, [None] * len(responses))
        # the pool recovered from the killed (timed-out) and the exited process: later calls are scored
        again = scorer.score(["p", "p"], ["x", "sleep"], [None, None])
    finally:
        scorer.shutdown()
    assert scores.tolist() == [2.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 4.0, 3.0]
    assert again.tolist() == [1.0, -1.0]
    assert scorer.pop_metrics() == {"reward/errors": 5.0, "reward/timeouts": 2.0}
    assert scorer.pop_metrics() == {"reward/errors": 0.0, "reward/timeouts": 0.0}
    err = capfd.readouterr().err
    warning = next(x for x in err.splitlines() if x.startswith("warning: 6 of 9 rewards"))
    assert "user_reward_mod:score raised ValueError: boom on sample 1" in warning, warning
    assert "noise on stdout" in err  # the user's prints went to stderr


@pytest.mark.parametrize("response, words", [
    ("raise", ["raised ValueError: boom"]),
    ("str", ["returned str '1.0'"]),
    ("nan", ["returned nan"]),
    ("sleep", ["took longer than reward.timeout_s=1"]),
])
def test_fail_mode_names_the_function_and_the_sample(user_module, response, words):
    scorer = _scorer(user_module, on_error="fail", timeout_s=1.0)
    try:
        with pytest.raises(RewardError) as e:
            scorer.score(["What is 1+1?", "q2"], ["ok", response], ["2", "3"])
    finally:
        scorer.shutdown()
    msg = str(e.value)
    assert "\n" not in msg and "reward.fn user_reward_mod:score" in msg and "sample 1" in msg, msg
    assert "'q2'" in msg and "reward.on_error=fail" in msg
    for w in words:
        assert w in msg, msg


def test_builtin_reward_runs_in_process_and_an_unloadable_module_is_named(tmp_path, monkeypatch):
    scorer = _scorer("exact_match")
    assert scorer.pool is None
    assert scorer.score(["q", "q"], ["#### 4", "5"], ["4", "4"]).tolist() == [1.0, 0.0]
    # importable in the driver, but failing in the reward process: one line naming the spec
    (tmp_path / "half_mod.py").write_text("import os\nif os.environ.get('RLHF_TEST_BREAK'):\n    raise "
                                          "ImportError('broken')\ndef f(p, r, g):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    scorer = _scorer("half_mod:f")
    monkeypatch.setenv("RLHF_TEST_BREAK", "1")
    with pytest.raises(Exception, match=r"reward.fn cannot load half_mod:f: ImportError: broken"):
        scorer.score(["q"], ["r"], [None])
    scorer.shutdown()
    assert math.isfinite(RewardConfig().fallback_score)


def test_reward_module_is_checked_in_a_bounded_process_not_imported_by_the_driver(tmp_path, monkeypatch):
    """The fail-fast check of reward.fn loads the user's module in a reward process: one whose import hangs
    is named within the start timeout, and the driver never runs the module's top-level code."""
    import sys
    import time

    from rlhf.driver.rl import reward_pool
    from rlhf.driver.rl.rewards import check_reward_fn
    from rlhf.errors import UserError

    (tmp_path / "hang_mod.py").write_text("import time\ntime.sleep(3600)\ndef f(p, r, g):\n    return 1.0\n")
    (tmp_path / "ok_mod.py").write_text("VALUE = 3\ndef f(p, r, g):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(reward_pool, "START_TIMEOUT_S", 3.0)
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"^reward.fn hang_mod:f: its process did not import the function within 3 s$"):
        check_reward_fn(RewardConfig(fn="hang_mod:f", timeout_s=1.0))
    assert time.monotonic() - t0 < 30
    check_reward_fn(RewardConfig(fn="ok_mod:f"))
    with pytest.raises(UserError, match=r"cannot load ok_mod:VALUE: TypeError: VALUE is a int, not a function"):
        check_reward_fn(RewardConfig(fn="ok_mod:VALUE"))
    assert "hang_mod" not in sys.modules and "ok_mod" not in sys.modules
