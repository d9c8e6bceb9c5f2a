"""run_distributed (workers/megatron/launch.py): ranks forked from one preloaded fork server per caller, with the
caller's environment as it is at each call, and a failing rank's traceback in the error."""

from __future__ import annotations

import os

import pytest
from mcore_train_fns import launch_fails, launch_probe

from workers.megatron.launch import DistributedError, run_distributed

PROBE = "RLHF_LAUNCH_PROBE"


def test_ranks_fork_from_one_server_and_see_the_callers_environment_at_each_call(monkeypatch):
    monkeypatch.setenv(PROBE, "first")
    a = run_distributed(launch_probe, 2, args=(PROBE,))
    monkeypatch.setenv(PROBE, "second")  # after the server started: it must still reach the ranks
    b = run_distributed(launch_probe, 1, args=(PROBE,))
    monkeypatch.delenv(PROBE)
    c = run_distributed(launch_probe, 1, args=(PROBE,))
    assert [r["rank"] for r in a] == [0, 1]
    assert [r["value"] for r in (*a, *b, *c)] == ["first", "first", "second", None]
    parents = {r["ppid"] for r in (*a, *b, *c)}
    assert len(parents) == 1 and os.getpid() not in parents  # one fork server, not this process
    assert all(r["preloaded"] for r in (*a, *b, *c))  # torch, megatron-core, transformers came with the fork


def test_a_failing_rank_raises_with_its_traceback():
    with pytest.raises(DistributedError, match=r"(?s)rank \d failed:.*ValueError: boom at rank"):
        run_distributed(launch_fails, 2, args=("boom at rank",))
