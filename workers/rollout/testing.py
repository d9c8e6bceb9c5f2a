"""`SyncPolicyWorker`: PolicyWorker plus the weight-sync method, for tests and benchmarks.

Until `RolloutSyncMixin` is a base of `workers.roles.policy.PolicyWorker` itself, groups that sync use
this class (defined in an importable module so Ray actors can load it).
"""

from __future__ import annotations

from workers.roles.policy import PolicyWorker
from workers.rollout.policy_mixin import RolloutSyncMixin


class SyncPolicyWorker(RolloutSyncMixin, PolicyWorker):
    """PolicyWorker with `send_weights_to_rollout`."""


def policy_worker_cls() -> type:
    """PolicyWorker when it already has the sync method, else SyncPolicyWorker."""
    return PolicyWorker if hasattr(PolicyWorker, "send_weights_to_rollout") else SyncPolicyWorker
