"""Errors raised by worker groups (every role, the rollout engines included) and the words that name a rank.

Every failure of a role derives from `WorkerGroupError`, so the CLI reports all of them the same way: one
line naming the role, rank, node and pid, and exit code 2.
"""

from __future__ import annotations

import re
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
