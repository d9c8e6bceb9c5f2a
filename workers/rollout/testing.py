"""`policy_worker_cls()`: the policy worker class that has the weight-sync method, for tests and benches.

`workers.roles.policy.PolicyWorker` mixes in `RolloutSyncMixin`; for a PolicyWorker without it, a
subclass is built here (module level, so Ray actors can import it).
"""

from __future__ import annotations

from workers.roles.policy import PolicyWorker
from workers.rollout.policy_mixin import RolloutSyncMixin

if issubclass(PolicyWorker, RolloutSyncMixin):
    SyncPolicyWorker = PolicyWorker
else:
    class SyncPolicyWorker(RolloutSyncMixin, PolicyWorker):  # type: ignore[no-redef]
        """PolicyWorker with `send_weights_to_rollout`."""


def policy_worker_cls() -> type:
    return SyncPolicyWorker
