"""The behaviour policy's log-probs in the objective: ``old_logprobs``' one home.

The ratio of every objective starts from ``old_logp``: the policy's recomputed log-probs (``recompute``), the
engine's (``rollout``), or the update's own forward, detached (``in_update``, where the caller passes
``logp.detach()``). When the engine's sampled-token log-probs (``rollout_logp``) are there too, the two
differ by the engine's numerics and, for samples of an older policy, by the policy's step; ``behaviour``
measures that (``mismatch/*``, ``algorithms.logprob_mismatch``) and applies the off-policy correction
(``off_policy/*``, ``algorithms.rollout_correction``: TIS weights the advantages, MIS narrows the mask).

``objective_loss`` calls it, so the policy worker's loss is one call whatever the source. Its metrics are
token means over the mask given, except ``MAX_METRICS`` (maxima); a caller summing micro-batches weights
the means by the mask's token count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..mismatch import logprob_mismatch
from ..off_policy import rollout_correction

__all__ = ["MAX_METRICS", "Behaviour", "behaviour", "behaviour_mask"]

# the metrics of `behaviour` that are maxima over tokens (the others are token means)
MAX_METRICS = ("mismatch/logprob_abs_diff_max", "off_policy/is_ratio_max")


@dataclass
class Behaviour:
    """The objective's advantages and mask after the correction, and the metrics (floats)."""

    advantages: torch.Tensor
    mask: torch.Tensor
    metrics: dict[str, float]


def _correction(options: Mapping[str, Any]) -> tuple[str, dict[str, float]]:
    kind = str(options.get("off_policy_correction", "none"))
    bounds = {"cap": options.get("is_cap", 2.0), "low": options.get("is_low", 0.5), "high": options.get("is_high", 2.0)}
    return kind, {k: float(v) for k, v in bounds.items()}


def behaviour(old_logp: torch.Tensor, rollout_logp: torch.Tensor | None, advantages: torch.Tensor,
              mask: torch.Tensor, options: Mapping[str, Any]) -> Behaviour:
    """``mismatch/*`` of ``rollout_logp`` to ``old_logp`` and the correction ``options["off_policy_correction"]``
    (``is_cap`` / ``is_low`` / ``is_high``) on ``advantages`` and ``mask``, all [B, T]. No ``rollout_logp``:
    nothing to compare or correct, the inputs come back as they are."""
    if rollout_logp is None:
        return Behaviour(advantages, mask, {})
    metrics = {f"mismatch/{k}": v for k, v in logprob_mismatch(rollout_logp, old_logp, mask).items()}
    kind, bounds = _correction(options)
    if kind == "none":
        return Behaviour(advantages, mask, metrics)
    weights, keep, om = rollout_correction(old_logp.detach(), rollout_logp, mask, kind, **bounds)
    metrics |= {f"off_policy/{k}": v for k, v in om.items()}
    return Behaviour(advantages * weights, keep if kind.startswith("mis") else mask, metrics)


def behaviour_mask(old_logp: torch.Tensor, rollout_logp: torch.Tensor | None, mask: torch.Tensor,
                   options: Mapping[str, Any]) -> torch.Tensor:
    """The mask ``behaviour`` trains on (MIS drops tokens or sequences; else ``mask``), for the loss's
    normaliser, which a mini-batch takes before its micro-batches run."""
    kind, bounds = _correction(options)
    if rollout_logp is None or not kind.startswith("mis"):
        return mask
    return rollout_correction(old_logp.detach(), rollout_logp, mask, kind, **bounds)[1]
