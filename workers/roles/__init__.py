"""The Megatron roles run by worker groups: policy, reference, critic and reward model."""

from workers.roles.base import MegatronWorker
from workers.roles.critic import CriticWorker
from workers.roles.loss_config import PPOLossConfig, ValueLossConfig
from workers.roles.policy import PolicyWorker
from workers.roles.reference import ReferenceWorker
from workers.roles.reward_model import RewardModelWorker
from workers.roles.weights import fetch_state_dict

__all__ = [
    "CriticWorker",
    "MegatronWorker",
    "PPOLossConfig",
    "PolicyWorker",
    "ReferenceWorker",
    "RewardModelWorker",
    "ValueLossConfig",
    "fetch_state_dict",
]
