"""KL estimators between the policy and a reference policy, KL controllers, and the KL reward penalty.

Estimators take per-token log-probabilities of the *sampled* tokens, ``logp`` (policy) and
``ref_logp`` (reference), both [B, T], and return a per-token estimate of KL(policy || ref) [B, T]
(Schulman, "Approximating KL divergence", 2020). With ``d = logp - ref_logp``:

- ``k1`` (alias ``kl``): ``d`` (unbiased, can be negative)
- ``k2`` (alias ``mse``): ``0.5 * d^2``
- ``k3`` (alias ``low_var_kl``): ``exp(-d) + d - 1``, with ``-d`` clamped to [-20, 20] and the result
  to [-10, 10]; always >= 0
- ``abs``: ``|d|``
- ``<kind>+`` (e.g. ``k3+``, ``low_var_kl+``): the value of ``<kind>`` with the gradient of ``k2``
  (straight-through): ``k2 - k2.detach() + kind.detach()``; as a loss its gradient is the unbiased
  gradient of KL.

The aliases (``KL_ALIASES``) are verl's ``kl_penalty`` names, which compute the same values, so a
config ported from verl keeps working. verl's ``full`` (the exact KL over the whole vocabulary) is not
an estimator from sampled-token log-probabilities and is not supported.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = [
    "KL_ALIASES",
    "KL_CONTROLLERS",
    "KL_KINDS",
    "canonical_kl_kind",
    "kl_estimate",
    "FixedKLController",
    "AdaptiveKLController",
    "make_kl_controller",
    "apply_kl_penalty",
]

# verl's names for the same estimators (verl's "abs" is ours already)
KL_ALIASES: dict[str, str] = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
_BASE_KINDS = ("k1", "k2", "k3", "abs")
_NAMES = _BASE_KINDS + tuple(KL_ALIASES)
# every accepted name: the base kinds, their aliases, and the straight-through "+" form of each
KL_KINDS: tuple[str, ...] = _NAMES + tuple(k + "+" for k in _NAMES)
# the KL coefficient controllers of ``make_kl_controller``
KL_CONTROLLERS: tuple[str, ...] = ("fixed", "adaptive")


def canonical_kl_kind(kind: str) -> str:
    """Our name for ``kind`` (``"low_var_kl+"`` -> ``"k3+"``); ``ValueError`` listing the known names."""
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    base = KL_ALIASES.get(base, base)
    if base not in _BASE_KINDS:
        hint = " (verl's full-vocabulary KL is not supported)" if base == "full" else ""
        raise ValueError(f"unknown KL estimator {kind!r}{hint}; known: {', '.join(KL_KINDS)}")
    return base + "+" if straight_through else base


def _k2(d: torch.Tensor) -> torch.Tensor:
    return 0.5 * d.square()


def _forward(kind: str, d: torch.Tensor) -> torch.Tensor:
    if kind == "k1":
        return d
    if kind == "k2":
        return _k2(d)
    if kind == "abs":
        return d.abs()
    # k3: x = log(ref/pi) = -d; exp(x) - x - 1 written as expm1(x) - x, which stays >= 0 in floating
    # point for tiny x (exp(x) - 1 would round to 0 and leave -x < 0).
    x = torch.clamp(-d, -20.0, 20.0)
    return torch.clamp(torch.expm1(x) - x, -10.0, 10.0)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token KL estimate of ``kind`` (see module doc) from ``logp``, ``ref_logp`` [B, T] -> [B, T].

    Unknown kinds raise ``ValueError`` listing the known ones.
    """
    kind = canonical_kl_kind(kind)
    straight_through = kind.endswith("+")
    base = kind.rstrip("+")
    d = logp - ref_logp
    value = _forward(base, d)
    if not straight_through or base == "k2":
        return value
    k2 = _k2(d)
    return k2 - k2.detach() + value.detach()


def _as_float(x: float | torch.Tensor) -> float:
    return float(x.detach().item()) if isinstance(x, torch.Tensor) else float(x)


class FixedKLController:
    """Constant KL coefficient ``beta``; ``update`` does nothing."""

    kind = "fixed"

    def __init__(self, init_beta: float) -> None:
        if init_beta < 0:
            raise ValueError(f"init_beta must be >= 0, got {init_beta}")
        self.value = float(init_beta)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> float:
        """No-op; returns the (unchanged) coefficient."""
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind", self.kind) != self.kind:
            raise ValueError(f"state of a {state.get('kind')!r} controller loaded into a {self.kind!r} one")
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 ("Fine-Tuning LMs from Human Preferences").

    ``update(kl, n_steps)``: ``err = clip(kl / target - 1, -0.2, 0.2)``;
    ``beta *= 1 + err * n_steps / horizon``. beta grows when the KL is above target and shrinks below.
    """

    kind = "adaptive"

    def __init__(self, init_beta: float, target: float, horizon: float) -> None:
        if init_beta < 0:
            raise ValueError(f"init_beta must be >= 0, got {init_beta}")
        if target is None or not target > 0:
            raise ValueError(f"adaptive KL controller needs target > 0, got {target}")
        if horizon is None or not horizon > 0:
            raise ValueError(f"adaptive KL controller needs horizon > 0, got {horizon}")
        self.value = float(init_beta)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float | torch.Tensor, n_steps: int) -> float:
        """Move beta towards the target KL after ``n_steps`` samples/steps; returns the new beta."""
        kl = _as_float(current_kl)
        if not math.isfinite(kl):
            return self.value
        err = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind", self.kind) != self.kind:
            raise ValueError(f"state of a {state.get('kind')!r} controller loaded into a {self.kind!r} one")
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))


def make_kl_controller(
    kind: str, init_beta: float, target: float | None = None, horizon: float | None = None
) -> FixedKLController | AdaptiveKLController:
    """``"fixed"`` -> ``FixedKLController(init_beta)``; ``"adaptive"`` -> needs ``target`` and ``horizon``."""
    if kind == "fixed":
        return FixedKLController(init_beta)
    if kind == "adaptive":
        return AdaptiveKLController(init_beta, target, horizon)  # type: ignore[arg-type]
    raise ValueError(f"unknown KL controller {kind!r}; known: {', '.join(KL_CONTROLLERS)}")


def apply_kl_penalty(
    token_rewards: torch.Tensor,
    kl: torch.Tensor,
    beta: float | torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL in the reward: ``(token_rewards - beta * kl) * mask``; all tensors [B, T].

    Returns the penalised rewards and the mean KL metric, a 0-dim detached tensor: the masked
    per-sequence mean of ``kl``, averaged over sequences with at least one mask-1 token (the value
    to feed to ``AdaptiveKLController.update``).
    """
    m = mask.to(token_rewards.dtype)
    kl_m = kl * m
    rewards = (token_rewards - beta * kl_m) * m
    with torch.no_grad():
        counts = m.sum(dim=-1)
        per_seq = kl_m.detach().sum(dim=-1) / counts.clamp_min(1.0)
        valid = (counts > 0).to(per_seq.dtype)
        kl_mean = (per_seq * valid).sum() / valid.sum().clamp_min(1.0)
    return rewards, kl_mean
