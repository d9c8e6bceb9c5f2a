"""Errors raised by worker groups; each names the role and rank it is about."""

from __future__ import annotations


class WorkerGroupError(RuntimeError):
    """A group call failed: a rank raised, died or the group is unusable after an earlier failure."""


class WorkerDiedError(WorkerGroupError):
    """A rank's actor process died (killed, crashed, out of memory)."""


class WorkerTimeoutError(WorkerGroupError, TimeoutError):
    """A group call did not finish within its timeout."""


class ResourceUnavailableError(WorkerGroupError):
    """The cluster cannot hold the resources a group asked for."""
