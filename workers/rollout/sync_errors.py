"""The errors of weight sync (raised by the transports, the syncer and the digest check)."""

from __future__ import annotations

from workers.group.errors import WorkerGroupError, WorkerTimeoutError


class WeightSyncError(WorkerGroupError):
    """A weight sync failed; the message names the rollout and policy ranks involved."""


class WeightSyncTimeout(WeightSyncError, WorkerTimeoutError):
    """A weight sync transfer did not complete within its timeout."""
