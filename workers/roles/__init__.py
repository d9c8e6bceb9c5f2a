"""The Megatron roles run by worker groups: policy, reference, critic and reward model."""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use, so that importing one light module of this package (its config classes, which
# the schema builds on) does not import Ray, torch.distributed or vLLM.
_EXPORTS = {
    "CriticWorker": "workers.roles.critic",
    "MegatronWorker": "workers.roles.base",
    "PPOLossConfig": "workers.roles.loss_config",
    "PolicyWorker": "workers.roles.policy",
    "ReferenceWorker": "workers.roles.reference",
    "RewardModelWorker": "workers.roles.reward_model",
    "ValueLossConfig": "workers.roles.loss_config",
    "fetch_state_dict": "workers.roles.weights",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
