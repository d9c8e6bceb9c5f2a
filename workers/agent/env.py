"""Environments: multi-turn tasks whose feedback is not a tool result (a guessing game, a test runner that
reports failures back). An environment is a class, named in the config as `module:Class`, made once per
trajectory:

    class MyEnv:
        def reset(self, messages, ground_truth) -> None: ...       # the prompt and its answer
        def step(self, action: str) -> tuple[str | None, float, bool]: ...  # observation, reward, done

After each model turn without a tool call, `step` gets the turn's text; its observation comes back to the
model as a user message, and its rewards, aggregated per `rollout.env_reward` (sum | last | mean), become the
trajectory's score. A failing or hanging environment ends its trajectory with the rewards so far (counted in
`agent/env_errors`), never the run.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol

AGGREGATIONS: dict[str, Callable[[list[float]], float]] = {
    "sum": lambda r: float(sum(r)),
    "last": lambda r: float(r[-1]) if r else 0.0,
    "mean": lambda r: float(sum(r) / len(r)) if r else 0.0,
}


class Environment(Protocol):
    def reset(self, messages: list[dict[str, str]], ground_truth: Any) -> None: ...

    def step(self, action: str) -> tuple[str | None, float, bool]: ...


def load_env(spec: str) -> Callable[[], Environment]:
    """The environment class named `module:Class` (checked to have reset and step)."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"environment {spec!r}: expected module:Class")
    cls = getattr(importlib.import_module(module), name, None)
    if cls is None or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        raise ValueError(f"environment {spec!r}: no class {name!r} with reset() and step() in {module}")
    return cls


class GuessNumber:
    """A tiny built-in environment (`workers.agent.env:GuessNumber`): guess the ground-truth integer; each
    wrong guess is answered "higher" or "lower"; reward 1 for the right guess, 0 otherwise."""

    def reset(self, messages: list[dict[str, str]], ground_truth: Any) -> None:
        self.target = int(ground_truth)

    def step(self, action: str) -> tuple[str | None, float, bool]:
        digits = "".join(ch for ch in action if ch.isdigit() or ch == "-")
        try:
            guess = int(digits)
        except ValueError:
            return "Answer with a number.", 0.0, False
        if guess == self.target:
            return None, 1.0, True
        return ("higher" if guess < self.target else "lower"), 0.0, False
