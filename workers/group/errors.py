"""Errors raised by worker groups (every role, the rollout engines included) and the words that name a rank.

Every failure of a role derives from `WorkerGroupError`, so the CLI reports all of them the same way: one
line naming the role, rank, node and pid, and exit code 2.
"""

from __future__ import annotations

import os
import re
import subprocess
from typing import Any


class WorkerGroupError(RuntimeError):
    """A group call failed: a rank raised, died or the group is unusable after an earlier failure."""


class WorkerDiedError(WorkerGroupError):
    """A rank's actor process died (killed, crashed, out of memory)."""


class NodeLostError(WorkerDiedError):
    """A rank died with its node: the node left the cluster (the message names it and every rank lost)."""


class WorkerTimeoutError(WorkerGroupError, TimeoutError):
    """A group call did not finish within its timeout."""


class ResourceUnavailableError(WorkerGroupError):
    """The cluster cannot hold the resources a group asked for."""


def describe_rank(role: str, rank: int, name: str, info: dict[str, Any]) -> str:
    """"role 'policy' rank 1 (policy/dp1-tp0-pp0) on node 10.0.0.2 (3f2a9c1e), pid 4242"; `info` holds
    `node_ip`, `node_id` and `pid` once the rank has reported them (before that the node is '?')."""
    where = f"node {info['node_ip']} ({info['node_id'][:8]}), pid {info['pid']}" if "node_ip" in info else "node ?"
    return f"role {role!r} rank {rank} ({name}) on {where}"


def first_lines(text: str, n: int) -> str:
    """The first `n` lines of a (remote) error text, without colour codes and caret-only lines."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    lines = [ln for ln in text.strip().splitlines() if ln.strip().strip("^~")]
    return "\n".join(lines[:n]) + (f"\n... ({len(lines) - n} more lines)" if len(lines) > n else "")


def refuse_taken_names(names: list[str], error: type[Exception], what: str = "group") -> None:
    """Raise `error` naming the first of `names` already held by a live Ray actor (a group or rollout group
    of that name is still up in this Ray session)."""
    import ray

    for name in names:
        try:
            ray.get_actor(name)
        except ValueError:
            continue
        raise error(f"an actor named {name!r} already exists; shut that {what} down or pass name=")


def oom_kill_count() -> int:
    """How many processes the kernel's OOM killer has killed on this node since boot (/proc/vmstat)."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


OOM_KILLS_AT_START = oom_kill_count()  # this process's baseline: kills before it are another run's


def _oom_victims() -> list[str]:
    """The kernel log's "Killed process PID (NAME) ... anon-rss" lines, where this process may read it."""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = re.findall(r"Killed process (\d+) \(([^)]*)\)[^\n]*?anon-rss:(\d+)kB[^\n]*?UID:(\d+)", log)
    return [f"pid {pid} ({name}, uid {uid}, {int(rss) >> 10} MB resident)" for pid, name, rss, uid in found]


def _largest_process() -> str:
    """The process holding the most resident memory on this node now."""
    best, best_rss = "", 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            if rss > best_rss:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = " ".join(f.read().replace(b"\0", b" ").decode(errors="replace").split())[:80]
                best, best_rss = f"pid {pid} ({cmd}, {rss >> 20} MB)", rss
        except (OSError, ValueError, IndexError):
            continue
    return best


def oom_note(since: int | None = None) -> str:
    """For an error about a dead process: a line saying that the kernel's OOM killer killed processes on
    this node after `since` (default: this process's start), naming its victims where the kernel log is
    readable, and the largest process now; "" when there was no OOM kill. Only this node is seen: a rank on
    another node that died of OOM is not named."""
    kills = oom_kill_count() - (OOM_KILLS_AT_START if since is None else since)
    if kills <= 0:
        return ""
    victims = _oom_victims()[-kills:][-3:]
    named = "; killed: " + ", ".join(victims) if victims else " (the kernel log naming them is not readable here)"
    largest = _largest_process()
    return (f"\n(out of memory: the kernel's OOM killer killed {kills} process(es) on this node{named}"
            + (f"; the largest process now is {largest}" if largest else "") + ")")
