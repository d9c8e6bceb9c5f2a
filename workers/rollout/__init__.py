"""Rollout: vLLM engines that sample responses, and weight sync from the Megatron policy into them.

vLLM is imported lazily (inside the worker), so importing this package is cheap.
"""

from __future__ import annotations

from workers.lazy import lazy_getattr

_EXPORTS = {  # name -> module, imported on first use (workers/lazy.py)
    "EngineConfig": "workers.rollout.config",
    "RolloutError": "workers.rollout.group",
    "RolloutGroup": "workers.rollout.group",
    "RolloutWorker": "workers.rollout.worker",
    "SamplingConfig": "workers.rollout.sampling",
    "SyncConfig": "workers.rollout.config",
    "WeightSyncError": "workers.rollout.sync_errors",
    "WeightSyncTimeout": "workers.rollout.sync_errors",
    "WeightSyncer": "workers.rollout.syncer",
    "choose_transport": "workers.rollout.registry",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
