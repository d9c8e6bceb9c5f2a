"""Worker groups: Ray actors of one role in one torch.distributed world, called like one object."""

from workers.group.errors import (
    ResourceUnavailableError,
    WorkerDiedError,
    WorkerGroupError,
    WorkerTimeoutError,
)
from workers.group.group import GroupFuture, WorkerGroup, rank_name
from workers.group.pool import ResourcePool
from workers.group.worker import Worker, WorkerContext

__all__ = [
    "GroupFuture",
    "ResourcePool",
    "ResourceUnavailableError",
    "Worker",
    "WorkerContext",
    "WorkerDiedError",
    "WorkerGroup",
    "WorkerGroupError",
    "WorkerTimeoutError",
    "rank_name",
]
