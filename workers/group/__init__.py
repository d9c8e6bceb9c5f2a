"""Worker groups: Ray actors of one role in one torch.distributed world, called like one object."""

from __future__ import annotations

from workers.lazy import lazy_getattr

_EXPORTS = {  # name -> module, imported on first use (workers/lazy.py)
    "GroupFuture": "workers.group.group",
    "ResourcePool": "workers.group.pool",
    "ResourceUnavailableError": "workers.group.errors",
    "Worker": "workers.group.worker",
    "WorkerContext": "workers.group.worker",
    "WorkerDiedError": "workers.group.errors",
    "NodeLostError": "workers.group.errors",
    "WorkerGroup": "workers.group.group",
    "WorkerGroupError": "workers.group.errors",
    "WorkerTimeoutError": "workers.group.errors",
    "rank_name": "workers.group.group",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
