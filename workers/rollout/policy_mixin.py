"""`RolloutSyncMixin`: the policy-side method of weight sync, to be mixed into `PolicyWorker`.

    class PolicyWorker(RolloutSyncMixin, LogprobMixin, MegatronWorker): ...

The session's transport does the sending with the worker: the bucketed ones need
`self.engine.iter_hf_weights()` (collective over TP), "shm" needs `self.engine.module` and
`self.engine.hf_config`; all use `self.ctx.rank`, `self.tp_rank`, `self.dp_rank`, `self.pp_rank` (all
present on `MegatronWorker`).
"""

from __future__ import annotations

from typing import Any

from workers.dispatch import ONE_TO_ALL, register
from workers.rollout.transport import SyncSession


class RolloutSyncMixin:
    """Adds the group method `send_weights_to_rollout(session)` (all ranks; collective)."""

    @register(ONE_TO_ALL)
    def send_weights_to_rollout(self, session: SyncSession) -> dict[str, Any]:
        """Send this policy's weights to the rollout engines of `session` with its transport."""
        with self.onloaded():
            return session.transport.local().send(self, session)
