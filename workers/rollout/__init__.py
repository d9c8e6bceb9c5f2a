"""Rollout: vLLM engines that sample responses, and weight sync from the Megatron policy into them.

vLLM is imported lazily (inside the worker), so importing this package is cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use, so that importing one light module of this package (its config classes, which
# the schema builds on) does not import Ray, torch.distributed or vLLM.
_EXPORTS = {
    "EngineConfig": "workers.rollout.config",
    "RolloutError": "workers.rollout.group",
    "RolloutGroup": "workers.rollout.group",
    "RolloutWorker": "workers.rollout.worker",
    "SamplingConfig": "workers.rollout.sampling",
    "SyncConfig": "workers.rollout.config",
    "WeightSyncError": "workers.rollout.transport",
    "WeightSyncTimeout": "workers.rollout.transport",
    "WeightSyncer": "workers.rollout.syncer",
    "choose_transport": "workers.rollout.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
