"""``objective_loss``: the policy's whole loss, the named objective on the behaviour-corrected inputs plus the
entropy bonus and the KL loss."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from ..aggregation import agg_loss
from ..kl import kl_estimate
from .behaviour import behaviour
from .registry import Metrics, ObjectiveInputs, get_objective, objective_options


def objective_loss(name: str, x: ObjectiveInputs, options: Mapping[str, Any], *,
                   entropy: torch.Tensor | None = None, entropy_coef: float = 0.0,
                   ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
                   kl_kind: str = "k3") -> tuple[torch.Tensor, Metrics, Metrics]:
    """``(loss, parts, metrics)``: ``loss = objective - entropy_coef * H + kl_coef * KL``.

    ``options``: every setting at hand (e.g. the loss config's fields); the objective takes the ones it names.
    With ``x.rollout_logp`` (the engine's log-probs) the inputs first go through ``behaviour``: ``mismatch/*``
    and ``off_policy/*`` join the metrics (token means over ``x.mask``, ``MAX_METRICS`` maxima), the correction
    ``options["off_policy_correction"]`` weights the advantages and (MIS) narrows the mask every term
    reduces over, and ``parts["tokens"]`` counts the tokens trained on.
    ``entropy`` [B, T] adds the bonus when ``entropy_coef != 0``; ``ref_logp`` [B, T] the KL loss (estimator
    ``kl_kind``) when ``kl_coef > 0``; both reduce like the objective (``x.agg_mode``, ``x.normalizer``).
    ``parts``: the detached terms (``pg_loss``, ``entropy_loss``, ``kl_loss``, ``loss``), each carrying the
    normaliser, so they sum over micro-batches; ``metrics``: the objective's, local means.
    """
    seen = behaviour(x.old_logp, x.rollout_logp, x.advantages, x.mask, options)
    if x.rollout_logp is not None:
        x = replace(x, advantages=seen.advantages, mask=seen.mask)
    pg, metrics = get_objective(name)(x, **objective_options(name, options))
    loss = pg
    parts = {"pg_loss": pg.detach()}
    if entropy is not None and entropy_coef != 0:
        ent_loss = agg_loss(entropy, x.mask, x.agg_mode, normalizer=x.normalizer, horizon=x.horizon)
        loss = loss - entropy_coef * ent_loss
        parts["entropy_loss"] = ent_loss.detach()
    if ref_logp is not None and kl_coef > 0:
        kl = agg_loss(kl_estimate(x.logp, ref_logp, kl_kind), x.mask, x.agg_mode, normalizer=x.normalizer,
                      horizon=x.horizon)
        loss = loss + kl_coef * kl
        parts["kl_loss"] = kl.detach()
    parts["loss"] = loss.detach()
    if x.rollout_logp is not None:
        parts["tokens"] = x.mask.detach().sum()
        metrics = {**metrics, **{k: torch.tensor(v, dtype=torch.float64) for k, v in seen.metrics.items()}}
    return loss, parts, metrics
