"""Rollout: vLLM engines that sample responses, and weight sync from the Megatron policy into them.

vLLM is imported lazily (inside the worker), so importing this package is cheap.
"""

from workers.rollout.config import EngineConfig, SyncConfig
from workers.rollout.group import RolloutError, RolloutGroup
from workers.rollout.registry import choose_transport
from workers.rollout.sampling import SamplingConfig
from workers.rollout.syncer import WeightSyncer
from workers.rollout.transport import WeightSyncError, WeightSyncTimeout
from workers.rollout.worker import RolloutWorker

__all__ = [
    "EngineConfig",
    "RolloutError",
    "RolloutGroup",
    "RolloutWorker",
    "SamplingConfig",
    "SyncConfig",
    "WeightSyncError",
    "WeightSyncTimeout",
    "WeightSyncer",
    "choose_transport",
]
