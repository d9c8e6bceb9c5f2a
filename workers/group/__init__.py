"""Worker groups: Ray actors of one role in one torch.distributed world, called like one object."""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use, so that importing one light module of this package (its config classes, which
# the schema builds on) does not import Ray, torch.distributed or vLLM.
_EXPORTS = {
    "GroupFuture": "workers.group.group",
    "ResourcePool": "workers.group.pool",
    "ResourceUnavailableError": "workers.group.errors",
    "Worker": "workers.group.worker",
    "WorkerContext": "workers.group.worker",
    "WorkerDiedError": "workers.group.errors",
    "WorkerGroup": "workers.group.group",
    "WorkerGroupError": "workers.group.errors",
    "WorkerTimeoutError": "workers.group.errors",
    "rank_name": "workers.group.group",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
