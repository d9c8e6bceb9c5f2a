"""The Megatron roles run by worker groups: policy, reference, critic and reward model."""

from __future__ import annotations

from workers.lazy import lazy_getattr

_EXPORTS = {  # name -> module, imported on first use (workers/lazy.py)
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

__getattr__ = lazy_getattr(__name__, _EXPORTS)
