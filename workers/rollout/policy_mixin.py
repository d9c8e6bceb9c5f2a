"""`RolloutSyncMixin`: the policy-side method of weight sync, to be mixed into `PolicyWorker`.

    class PolicyWorker(RolloutSyncMixin, LogprobMixin, MegatronWorker): ...

It needs `self.engine.iter_hf_weights()` (collective, full HF tensors of this rank's pipeline stage;
bucketed transports), `self.engine.module` and `self.engine.hf_config` (the "shm" transport writes each
rank's own shards, no collective), `self.ctx.rank`, `self.tp_rank`, `self.dp_rank`, `self.pp_rank` (all
present on `MegatronWorker`).
"""

from __future__ import annotations

from typing import Any

from workers.dispatch import ONE_TO_ALL, register
from workers.rollout.transport import SyncSession
from workers.rollout.weight_sync import send_weights


class RolloutSyncMixin:
    """Adds the group method `send_weights_to_rollout(session)` (all ranks; collective)."""

    @register(ONE_TO_ALL)
    def send_weights_to_rollout(self, session: SyncSession) -> dict[str, Any]:
        """Stream this policy's weights to the rollout engines of `session` (see workers.rollout.weight_sync)."""
        if session.transport == "shm":
            from workers.rollout.shm import write_weights

            with self.onloaded():
                return write_weights(self.engine.module, self.engine.hf_config, session, rank=self.ctx.rank,
                                     stage=self.pp_rank)
        is_source = self.tp_rank == 0 and self.dp_rank == 0
        with self.onloaded():
            return send_weights(self.engine.iter_hf_weights(), session, rank=self.ctx.rank, stage=self.pp_rank,
                                is_source=is_source)
