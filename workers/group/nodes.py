"""Which node each rank of the live groups runs on, so that the error for a node that left the cluster names
the node and every role and rank lost with it (not only the rank whose call failed first)."""

from __future__ import annotations

import socket
import weakref
from typing import Any

_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()  # worker groups and rollout groups (`role`/`name`, `infos`)


def register(group: Any) -> None:
    """Track `group` (its `infos` list the node of each rank) until it is shut down or collected."""
    _LIVE.add(group)


def unregister(group: Any) -> None:
    _LIVE.discard(group)


def lost_node(node_id: str | None, connect_timeout_s: float = 2.0) -> tuple[dict[str, Any], str] | None:
    """(Ray's record of node `node_id`, why it is lost) when the cluster has marked it dead or its raylet no
    longer accepts connections (Ray takes a few health checks, about 15 s, to mark a node dead), else None."""
    if not node_id:
        return None
    import ray

    try:
        node = next((n for n in ray.nodes() if n.get("NodeID") == node_id), None)
    except Exception:  # noqa: BLE001 - the cluster itself is gone: nothing to name
        return None
    if node is None:
        return None
    if not node.get("Alive"):
        return node, node.get("DeathReasonMessage") or "marked dead by the cluster"
    addr, port = node.get("NodeManagerAddress"), node.get("NodeManagerPort")
    try:
        socket.create_connection((addr, port), timeout=connect_timeout_s).close()
    except OSError as e:
        return node, f"its raylet at {addr}:{port} does not answer ({e.strerror or type(e).__name__})"
    return None


def held_by(node_id: str) -> str:
    """"policy ranks 2, 3 (policy/dp1-tp0-pp0@10.0.0.3, ...); rollout rank 1 (rollout/1@10.0.0.3)"."""
    parts = []
    for group in list(_LIVE):
        names = getattr(group, "names", [])
        lost = [(r, names[r] if r < len(names) else "?") for r, i in enumerate(getattr(group, "infos", []))
                if i.get("node_id") == node_id]
        if lost:
            role = getattr(group, "role", None) or getattr(group, "name", "?")
            ranks = ", ".join(str(r) for r, _ in lost)
            names = ", ".join(n for _, n in lost[:4]) + (", ..." if len(lost) > 4 else "")
            parts.append(f"{role} rank{'s' if len(lost) > 1 else ''} {ranks} ({names})")
    return "; ".join(parts) or "no rank of a live group"


def node_lost(node_id: str | None) -> str | None:
    """"node 10.0.0.3 (3f2a9c1e) left the cluster (why); lost with it: ..." when the node is lost, else None."""
    found = lost_node(node_id)
    if found is None:
        return None
    node, why = found
    return (f"node {node.get('NodeManagerAddress', '?')} ({str(node_id)[:8]}) left the cluster ({why}); "
            f"lost with it: {held_by(str(node_id))}")
