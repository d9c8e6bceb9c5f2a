"""Advantage estimators, registered by name.

Uniform calling convention (keyword-only; every estimator accepts all of these and ignores the ones
it does not use, unknown keywords raise ``TypeError``)::

    advantages, returns = get_advantage_estimator(name)(
        token_level_rewards=r,    # [B, T] float, reward of each response token
        response_mask=m,          # [B, T] 0/1, the response tokens being trained
        values=v,                 # [B, T] critic values (gae only)
        group_ids=g,              # [B] int tensor or list of hashables (alias: index); grouped estimators
        gamma=1.0, lam=1.0,       # discount and GAE lambda
        norm_by_std=True,         # grpo: divide by the group std (False: Dr. GRPO)
        eps=1e-6,                 # grpo std epsilon
        whiten_advantages=True,   # gae: masked whitening of the advantages over the batch
    )

Both outputs are [B, T], zero outside ``response_mask``, computed without autograd. Rewards at
masked-out positions are ignored. Sequence-level estimators (grpo, rloo, reinforce_plus_plus_baseline)
score each row by ``sum_t r[b, t] * m[b, t]`` and broadcast the advantage over the row's mask.
Grouped estimators compute their group statistics in float64 and give a group of size 1 (there is
no other sample to compare with) or a group whose scores are all equal (there is nothing to learn
from it) the advantage exactly 0, before any batch whitening.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from .masked import masked_whiten

__all__ = [
    "ADVANTAGE_KWARGS",
    "register_advantage_estimator",
    "get_advantage_estimator",
    "list_advantage_estimators",
    "compute_advantages",
    "gae",
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
]

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
GroupIds = torch.Tensor | Sequence[Hashable]

ADVANTAGE_KWARGS: frozenset[str] = frozenset(
    {
        "token_level_rewards",
        "response_mask",
        "values",
        "group_ids",
        "index",
        "gamma",
        "lam",
        "norm_by_std",
        "eps",
        "whiten_advantages",
    }
)

_REGISTRY: dict[str, AdvantageFn] = {}


def register_advantage_estimator(
    name: str, extra_kwargs: Sequence[str] = ()
) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator registering ``fn(**kwargs) -> (advantages, returns)`` under ``name``.

    The registered (and returned) callable checks the keywords against ``ADVANTAGE_KWARGS`` plus
    ``extra_kwargs``, maps ``index`` to ``group_ids`` and then calls ``fn`` with all of them, so
    ``fn`` should accept ``**_`` for the ones it ignores. Re-registering a name raises ``ValueError``.
    """
    allowed = ADVANTAGE_KWARGS | frozenset(extra_kwargs)

    def deco(fn: AdvantageFn) -> AdvantageFn:
        if name in _REGISTRY:
            raise ValueError(f"advantage estimator {name!r} is already registered")

        @functools.wraps(fn)
        def wrapper(**kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            unknown = set(kwargs) - allowed
            if unknown:
                raise TypeError(f"{name}: unknown keyword(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
            if "index" in kwargs:
                index = kwargs.pop("index")
                if kwargs.get("group_ids") is not None and index is not None:
                    raise TypeError(f"{name}: pass group_ids or index, not both")
                if kwargs.get("group_ids") is None:
                    kwargs["group_ids"] = index
            return fn(**kwargs)

        _REGISTRY[name] = wrapper
        return wrapper

    return deco


def list_advantage_estimators() -> list[str]:
    return sorted(_REGISTRY)


def get_advantage_estimator(name: str) -> AdvantageFn:
    """The estimator registered as ``name``; ``ValueError`` listing the known names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; known: {', '.join(list_advantage_estimators())}"
        ) from None


def compute_advantages(name: str, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``get_advantage_estimator(name)(**kwargs)``."""
    return get_advantage_estimator(name)(**kwargs)


# ----------------------------------------------------------------------------------------------- helpers


def _check(rewards: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if rewards.dim() != 2 or rewards.shape != mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(rewards.shape)} and response_mask {tuple(mask.shape)} must both be [B, T]"
        )
    dt = rewards.dtype if rewards.dtype == torch.float64 else torch.float32
    return rewards.detach().to(dt), mask.detach().to(dt)


def _group_index(group_ids: GroupIds | None, batch: int, device: torch.device, who: str) -> torch.Tensor:
    """Map arbitrary group ids to consecutive ints [B] (first appearance order irrelevant)."""
    if group_ids is None:
        raise ValueError(f"{who} needs group_ids (or index): one id per sequence")
    if isinstance(group_ids, torch.Tensor):
        ids = group_ids.reshape(-1)
        if ids.numel() != batch:
            raise ValueError(f"{who}: {ids.numel()} group ids for a batch of {batch}")
        return torch.unique(ids, return_inverse=True)[1].to(device)
    items = group_ids.tolist() if hasattr(group_ids, "tolist") else list(group_ids)
    if len(items) != batch:
        raise ValueError(f"{who}: {len(items)} group ids for a batch of {batch}")
    table: dict[Hashable, int] = {}
    inv = [table.setdefault(g, len(table)) for g in items]
    return torch.tensor(inv, dtype=torch.long, device=device)


def _group_stats(scores: torch.Tensor, inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence (group size, centred score ``s - mean_g``, unbiased group std), all float64.

    Computed in float64 so that rounding cannot invent a spread: a group whose scores are all equal
    gets a centred score and std of exactly 0 (in float32, 16 scores of 2.2 leave a std of ~1e-7,
    which ``/ (std + eps)`` blows up to advantages of ~0.2). Groups of size 1 have std 0.
    """
    s = scores.to(torch.float64)
    n_groups = int(inv.max().item()) + 1 if inv.numel() else 0
    counts = torch.zeros(n_groups, dtype=s.dtype, device=s.device).index_add_(0, inv, torch.ones_like(s))
    sums = torch.zeros_like(counts).index_add_(0, inv, s)
    mean = sums / counts.clamp_min(1.0)
    hi = torch.zeros_like(counts).scatter_reduce_(0, inv, s, reduce="amax", include_self=False)
    lo = torch.zeros_like(counts).scatter_reduce_(0, inv, s, reduce="amin", include_self=False)
    centered = torch.where((hi == lo)[inv], torch.zeros_like(s), s - mean[inv])
    sq = torch.zeros_like(counts).index_add_(0, inv, centered**2)
    std = torch.sqrt(sq / (counts - 1.0).clamp_min(1.0))
    return counts[inv], centered, std[inv]


def _sequence_scores(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_t r[b, t] * m[b, t]`` in float64 (see ``_group_stats``)."""
    return (rewards.to(torch.float64) * mask.to(torch.float64)).sum(dim=-1)


# -------------------------------------------------------------------------------------------- estimators


@register_advantage_estimator("gae")
@torch.no_grad()
def gae(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten_advantages: bool = True,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over the masked tokens of each row.

    Walking back over mask-1 positions only (t' = the next mask-1 position after t, V(t') = 0 past
    the last one)::

        delta_t = r_t + gamma * V(t') - V(t)
        A_t     = delta_t + gamma * lam * A_t'
        returns = A + values          (before whitening)

    Optionally ``A <- masked_whiten(A)`` over the batch. Inputs [B, T]; outputs [B, T].
    """
    r, m = _check(token_level_rewards, response_mask)
    if values is None:
        raise ValueError("gae needs values [B, T]")
    if values.shape != r.shape:
        raise ValueError(f"values {tuple(values.shape)} must match token_level_rewards {tuple(r.shape)}")
    v = values.detach().to(r.dtype)
    batch, horizon = r.shape
    next_value = torch.zeros(batch, dtype=r.dtype, device=r.device)
    last_adv = torch.zeros_like(next_value)
    adv = torch.zeros_like(r)
    for t in range(horizon - 1, -1, -1):
        keep = m[:, t] > 0
        delta = r[:, t] + gamma * next_value - v[:, t]
        last_adv = torch.where(keep, delta + gamma * lam * last_adv, last_adv)
        next_value = torch.where(keep, v[:, t], next_value)
        adv[:, t] = last_adv
    returns = (adv + v) * m
    if whiten_advantages:
        adv = masked_whiten(adv, m)
    return adv * m, returns


@register_advantage_estimator("grpo")
@torch.no_grad()
def grpo(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds | None = None,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative outcome advantage (Shao et al. 2024).

    ``s_b = sum_t r[b,t] m[b,t]``; ``A_b = (s_b - mean_g) / (std_g + eps)`` with the unbiased group
    std, or ``A_b = s_b - mean_g`` when ``norm_by_std=False`` (Dr. GRPO). Groups of size 1 and groups
    of equal scores get exactly 0 (float64 statistics, see the module doc).
    ``A`` is broadcast over the row's mask; returns = advantages. Inputs [B, T], group_ids [B].
    """
    r, m = _check(token_level_rewards, response_mask)
    scores = _sequence_scores(r, m)
    inv = _group_index(group_ids, r.shape[0], r.device, "grpo")
    counts, centered, std = _group_stats(scores, inv)
    adv = centered / (std + eps) if norm_by_std else centered
    adv = torch.where(counts > 1, adv, torch.zeros_like(adv))
    adv = adv.to(r.dtype).unsqueeze(-1) * m
    return adv, adv.clone()


@register_advantage_estimator("rloo")
@torch.no_grad()
def rloo(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024).

    ``A_b = s_b - mean_{j in g, j != b} s_j = (n / (n - 1)) * (s_b - mean_g)`` for a group of size n;
    groups of size 1 and groups of equal scores get exactly 0. Broadcast over the mask; returns = advantages.
    """
    r, m = _check(token_level_rewards, response_mask)
    scores = _sequence_scores(r, m)
    inv = _group_index(group_ids, r.shape[0], r.device, "rloo")
    counts, centered, _std = _group_stats(scores, inv)
    adv = centered * counts / (counts - 1.0).clamp_min(1.0)
    adv = torch.where(counts > 1, adv, torch.zeros_like(adv))
    adv = adv.to(r.dtype).unsqueeze(-1) * m
    return adv, adv.clone()


@register_advantage_estimator("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted reward-to-go, whitened over the batch.

    ``G_t = r_t + gamma * G_t'`` over the mask-1 positions of a row (t' the next one);
    ``A = masked_whiten(G)`` over all mask-1 tokens of the batch; returns = ``G`` (unwhitened).
    Holes in the mask (e.g. tool-output tokens in a multi-turn response) are skipped, not treated as
    the end of the sequence: the return flows across them (verl resets it there; with plain right
    padding the two agree).
    """
    r, m = _check(token_level_rewards, response_mask)
    batch, horizon = r.shape
    running = torch.zeros(batch, dtype=r.dtype, device=r.device)
    returns = torch.zeros_like(r)
    for t in range(horizon - 1, -1, -1):
        running = torch.where(m[:, t] > 0, r[:, t] + gamma * running, running)
        returns[:, t] = running
    returns = returns * m
    return masked_whiten(returns, m) * m, returns


@register_advantage_estimator("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline(
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: ``s_b - mean_g`` (exactly 0 for groups of size 1 or of equal
    scores), broadcast over the mask, then whitened over all mask-1 tokens of the batch;
    returns = advantages.
    """
    r, m = _check(token_level_rewards, response_mask)
    scores = _sequence_scores(r, m)
    inv = _group_index(group_ids, r.shape[0], r.device, "reinforce_plus_plus_baseline")
    counts, centered, _std = _group_stats(scores, inv)
    centered = torch.where(counts > 1, centered, torch.zeros_like(centered)).to(r.dtype)
    adv = masked_whiten(centered.unsqueeze(-1) * m, m) * m
    return adv, adv.clone()
