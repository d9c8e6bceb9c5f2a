"""Resolve the configured reward (a rule name, a `module:function`, or a reward-model group) and score batches."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from algorithms.rewards import get_reward_fn, list_rewards
from rlhf.errors import ConfigError

RewardCallable = Callable[[Any, str, Any], float]


def resolve_reward_fn(spec: str) -> RewardCallable:
    """`exact_match` (a name in algorithms.rewards) or `package.module:function`; fail fast with the reason."""
    if ":" in spec:
        module_name, _, fn_name = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ConfigError(f"reward.fn: cannot import module {module_name!r} of {spec!r}: {e}") from None
        fn = getattr(module, fn_name, None)
        if not callable(fn):
            raise ConfigError(f"reward.fn: module {module_name!r} has no function {fn_name!r}")
        return fn
    try:
        return get_reward_fn(spec)
    except (KeyError, ValueError):
        raise ConfigError(
            f"reward.fn: unknown reward function {spec!r}; expected one of {', '.join(list_rewards())} "
            "or module:function"
        ) from None


def score_batch(fn: RewardCallable, prompts: list, responses: list[str], ground_truths: list) -> torch.Tensor:
    """One float score per sample."""
    return torch.tensor([float(fn(p, r, g)) for p, r, g in zip(prompts, responses, ground_truths)],
                        dtype=torch.float32)
