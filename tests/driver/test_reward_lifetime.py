"""What a user's `module:function` reward starts dies with it, and its memory is bounded: real reward
processes whose function starts `sleep` (subprocess), a fork and a setsid'd daemon, all ignoring SIGTERM and
SIGINT, found from outside by a unique marker in their command line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from rlhf.driver.rl.reward_pool import RewardPool
from tests.helpers.procs import marked, wait_for

REPO = str(Path(__file__).resolve().parents[2])

USER_REWARD = '''
import os, signal, subprocess, time

def score(prompt, response, ground_truth):
    kind, _, marker = response.partition(":")
    if kind == "oom_score_adj":
        return float(open("/proc/self/oom_score_adj").read())
    if kind == "alloc":
        block = b"x" * (int(marker) << 20)  # written, so resident
        return float(len(block) >> 20)
    if kind not in ("hang", "leave"):
        return float(len(response))
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)
    subprocess.Popen(["sleep", marker])
    if os.fork() == 0:
        os.execvp("sleep", ["sleep", marker])
    middle = os.fork()
    if middle == 0:
        os.setsid()
        if os.fork() == 0:
            os.execvp("sleep", ["sleep", marker])
        os._exit(0)
    os.waitpid(middle, 0)
    if kind == "hang":
        time.sleep(3600)
    return 1.0
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "lifetime_reward_mod.py").write_text(USER_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))  # the reward processes get the driver's sys.path
    return "lifetime_reward_mod:score"


def _marker() -> str:
    """A unique, valid `sleep` duration."""
    return f"{6000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**9:09d}"


def _reap(marker: str) -> None:
    for pid in marked(marker):
        os.kill(pid, signal.SIGKILL)


CALLER = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from rlhf.driver.rl.reward_pool import RewardPool
pool = RewardPool("lifetime_reward_mod:score", 1, 600.0, 1024)
print(pool.score([("p", "hang:" + sys.argv[3], None)]), flush=True)
"""


def test_sigkill_of_the_driver_leaves_nothing_the_reward_started(user_module, tmp_path):
    """The driver is SIGKILLed while the user's function hangs with a subprocess, a fork and a daemon that
    ignore SIGTERM: 5 s later none of them is alive (before, all three lived on with parent 1)."""
    marker = _marker()
    caller = subprocess.Popen([sys.executable, "-c", CALLER, REPO, str(tmp_path), marker], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert wait_for(lambda: len(marked(marker)) >= 3, 60), (marked(marker), caller.poll())
        caller.kill()
        caller.wait(timeout=10)
        wait_for(lambda: not marked(marker), 5)
        assert marked(marker) == [], "still alive 5 s after the driver died"
    finally:
        caller.kill()
        caller.wait(timeout=10)
        _reap(marker)


def test_a_timed_out_call_takes_its_whole_process_tree(user_module):
    marker = _marker()
    pool = RewardPool(user_module, 1, 3.0, 1024)
    try:
        out = pool.score([("p", f"hang:{marker}", None), ("p", "ab", None)])
        assert [o.kind for o in out] == ["timeout", "ok"] and out[1].value == 2.0, out
        wait_for(lambda: not marked(marker), 5)
        assert marked(marker) == [], "the timed-out call's processes outlived it"
    finally:
        pool.shutdown()
        _reap(marker)


def test_shutdown_leaves_nothing_alive(user_module):
    marker = _marker()
    pool = RewardPool(user_module, 1, 30.0, 1024)
    try:
        out = pool.score([("p", f"leave:{marker}", None)])
        assert out[0].value == 1.0, out
        # left running by the function, as it may; a forked child shows the marker once it has exec'd
        assert wait_for(lambda: len(marked(marker)) == 3, 10), marked(marker)
        pool.shutdown()
        wait_for(lambda: not marked(marker), 5)
        assert marked(marker) == [], "RewardPool.shutdown left the function's processes alive"
    finally:
        pool.shutdown()
        _reap(marker)


def test_memory_beyond_reward_memory_mb_is_an_error_and_the_pool_goes_on(user_module):
    """A call allocating 400 MB against reward.memory_mb=256 is an error outcome that says memory; the
    process is replaced and later calls are scored. The reward process is the kernel's first OOM victim."""
    pool = RewardPool(user_module, 1, 60.0, 256)
    try:
        out = pool.score([("p", "alloc:400", None), ("p", "alloc:50", None), ("p", "oom_score_adj", None)])
    finally:
        pool.shutdown()
    assert out[0].kind == "error" and "memory" in out[0].message.lower(), out[0]
    assert out[1].value == 50.0 and out[2].value == 1000.0, out
