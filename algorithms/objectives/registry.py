"""The policy-objective registry: an objective turns the policy's token log-probs into a surrogate loss.

An objective is ``fn(x: ObjectiveInputs, *, <options>) -> (loss, metrics)``. Its options are keyword
parameters with defaults; the caller hands every setting it has (``objective_loss(..., options=...)``) and
each objective receives the ones its signature names, so a new objective with a new option needs the
function, a ``register_objective`` line and the option declared where the settings live, nothing else.
``check=`` registers a function of (some of) those options that raises ``ValueError`` on values the objective
cannot use.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["OBJECTIVES", "Metrics", "ObjectiveFn", "ObjectiveInputs", "check_objective", "get_objective",
           "list_objectives", "objective_options", "register_objective"]

Metrics = dict[str, torch.Tensor]
ObjectiveFn = Callable[..., tuple[torch.Tensor, Metrics]]
OptionCheck = Callable[..., None]


@dataclass
class ObjectiveInputs:
    """What every objective sees, all [B, T] over response tokens.

    ``old_logp``: the behaviour policy's log-probs (the ratio's denominator); ``rollout_logp``: the engine's,
    when the batch has them; ``agg_mode`` / ``normalizer`` / ``horizon``: how the token losses reduce
    (``algorithms.agg_loss``)."""

    logp: torch.Tensor
    old_logp: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    rollout_logp: torch.Tensor | None = None
    agg_mode: str = "token-mean"
    normalizer: float | torch.Tensor | None = None
    horizon: int | float | None = None


@dataclass(frozen=True)
class _Entry:
    fn: ObjectiveFn
    check: OptionCheck | None
    options: tuple[str, ...]


OBJECTIVES: dict[str, _Entry] = {}


def _option_names(fn: ObjectiveFn) -> tuple[str, ...]:
    params = inspect.signature(fn).parameters.values()
    return tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)


def _param_names(fn: OptionCheck) -> set[str]:
    return set(inspect.signature(fn).parameters)


def register_objective(name: str, check: OptionCheck | None = None) -> Callable[[ObjectiveFn], ObjectiveFn]:
    """Decorator: register ``fn`` as the objective ``name`` (a later registration of the name replaces it).
    Its keyword-only parameters are its options; ``check`` gets the same keywords and raises ``ValueError``."""

    def deco(fn: ObjectiveFn) -> ObjectiveFn:
        OBJECTIVES[name] = _Entry(fn, check, _option_names(fn))
        return fn

    return deco


def list_objectives() -> list[str]:
    """The registered objective names, sorted."""
    return sorted(OBJECTIVES)


def _entry(name: str) -> _Entry:
    if name not in OBJECTIVES:
        raise ValueError(f"unknown policy objective {name!r}; known: {', '.join(list_objectives())}")
    return OBJECTIVES[name]


def get_objective(name: str) -> ObjectiveFn:
    """The registered function of ``name``; ``ValueError`` listing the known names."""
    return _entry(name).fn


def objective_options(name: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``settings`` that objective ``name`` takes as options (absent ones keep its defaults)."""
    return {k: settings[k] for k in _entry(name).options if k in settings}


def check_objective(name: str, settings: Mapping[str, Any]) -> None:
    """``ValueError`` for an unknown name or option values the objective's ``check`` refuses (it gets the
    objective's options that its own signature names)."""
    entry = _entry(name)
    if entry.check is not None:
        wanted = _param_names(entry.check)
        entry.check(**{k: v for k, v in objective_options(name, settings).items() if k in wanted})
