"""Offline preference losses (DPO and kin) on per-sequence log-probabilities.

Inputs are one value per pair, [B]: the policy's summed log-probability of the chosen and the rejected
answer tokens, the reference's (ignored by the reference-free ``simpo`` and ``orpo``), and each answer's token
count.
With ``delta = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)``:

- ``sigmoid`` (DPO, Rafailov et al. 2023; conservative DPO with label smoothing ``eps``):
  ``-(1 - eps) * logsigmoid(beta * delta) - eps * logsigmoid(-beta * delta)``
- ``ipo`` (Azar et al. 2023), on log-ratios averaged over each answer's tokens, as TRL does:
  ``(chosen_logratio / n_chosen - rejected_logratio / n_rejected - 1 / (2 * beta)) ** 2``
- ``simpo`` (Meng et al. 2024), reference-free, on length-normalised log-probs ``a = logps / n``:
  ``h = beta * (a_chosen - a_rejected) - gamma``; loss ``-(1 - eps) * logsigmoid(h) - eps * logsigmoid(-h)``
- ``orpo`` (Hong et al. 2024), reference-free, odds ratio plus SFT, on the mean token log-probs ``a = logps / n``
  (``p = exp(a)``): ``log_odds(a) = a - log(1 - exp(a))``, ``lor = log_odds(a_chosen) - log_odds(a_rejected)``;
  loss ``-a_chosen - orpo_lambda * logsigmoid(lor)`` (the chosen answer's mean token NLL plus the odds-ratio
  term; ``beta`` is unused). ``log(1 - exp(a))`` is ``log1mexp`` (stable near p = 1), and ``a`` is clamped to
  at most ``-eps`` of its dtype first, so an answer the model is certain of (a = 0) keeps finite log odds.
- ``kto`` (Ethayarajh et al. 2024, ``algorithms.kto``) on the pair's two answers as two unpaired examples, the
  chosen one desirable and the rejected one undesirable: ``(l_desirable + l_undesirable) / 2``, each example's
  loss on its own log-ratio against the KL baseline ``z0`` (``kl_baseline``, from mismatched prompt / answer
  pairs). No term joins the two answers, so the pair's sum over the batch divided by the pair count is the
  mean over the batch's examples; the rewards are ``beta * logratio``.

With ``nll_coef = alpha > 0`` each pair's loss also gets ``alpha * (-chosen_logps / n_chosen)``, the chosen
answer's mean token NLL (RPO, Pang et al. 2024; OpenRLHF's ``nll_loss_coef``; TRL's ``rpo_alpha`` averages the
NLL over the batch's chosen tokens instead of per answer). Without it the sigmoid loss can grow the margin by
pushing both answers down, and the probability leaves for answers neither of them is.

The loss is returned per pair: the caller divides its sum by the global pair count (so micro-batching and
data parallelism do not change it). Rewards for the metrics: ``beta * logratio`` (``beta * a`` for simpo, the
log odds for orpo).

``bradley_terry_loss`` is the reward model's: ``-logsigmoid(score_chosen - score_rejected)`` per pair (Ouyang
et al. 2022; TRL's ``RewardTrainer`` without a margin), on the scalar scores of a value head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kto import kto_loss

__all__ = ["PREFERENCE_LOSSES", "REFERENCE_FREE_LOSSES", "bradley_terry_loss", "check_preference_loss", "log1mexp",
           "log_odds", "preference_loss"]

PREFERENCE_LOSSES = ("sigmoid", "ipo", "simpo", "orpo", "kto")
REFERENCE_FREE_LOSSES = ("simpo", "orpo")  # no reference log-probs: the DPO stage starts no reference pass
_LN_HALF = -0.6931471805599453  # log(1/2): where log1mexp switches form


def check_preference_loss(name: str) -> None:
    if name not in PREFERENCE_LOSSES:
        raise ValueError(f"unknown preference loss {name!r}; expected one of {', '.join(PREFERENCE_LOSSES)}")


def _smoothed(logits: torch.Tensor, eps: float) -> torch.Tensor:
    return -(1.0 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for x <= 0 without cancellation: ``log(-expm1(x))`` near 0 (where 1 - exp(x)
    loses its digits), ``log1p(-exp(x))`` below log(1/2) (where exp(x) is small)."""
    near = x > _LN_HALF
    return torch.where(near, torch.log(-torch.expm1(torch.where(near, x, _LN_HALF))),
                       torch.log1p(-torch.exp(torch.where(near, _LN_HALF, x))))


def log_odds(mean_logps: torch.Tensor) -> torch.Tensor:
    """``log(p / (1 - p))`` with ``p = exp(mean_logps)``; the mean log-prob is clamped to at most ``-eps`` of
    its dtype, so p = 1 gives large but finite log odds and gradients."""
    a = mean_logps.clamp(max=-torch.finfo(mean_logps.dtype).eps)
    return a - log1mexp(a)


def preference_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    chosen_lengths: torch.Tensor,
    rejected_lengths: torch.Tensor,
    loss: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    nll_coef: float = 0.0,
    orpo_lambda: float = 0.1,
    kl_baseline: torch.Tensor | None = None,
    kto_desirable_weight: float = 1.0,
    kto_undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss of each pair [B], per-pair values for the metrics) as in the module docstring.

    The metric tensors are detached, [B] each: ``rewards/chosen``, ``rewards/rejected``, ``rewards/margin``,
    ``rewards/accuracy`` (1.0 where the chosen reward is higher), ``logps/chosen``, ``logps/rejected``
    (summed log-probs), ``nll/chosen`` (the chosen answer's mean token NLL), and for orpo ``orpo/or_loss``
    (the odds-ratio term before ``orpo_lambda``), for kto ``kto/kl_baseline`` (z0, the same for every pair);
    reduce them as the caller's batch requires. ``kl_baseline``: kto's z0 (``algorithms.kto_kl_baseline``),
    used detached."""
    check_preference_loss(loss)
    n_c = chosen_lengths.to(chosen_logps.dtype).clamp(min=1.0)
    n_r = rejected_lengths.to(rejected_logps.dtype).clamp(min=1.0)
    extra: dict[str, torch.Tensor] = {}
    if loss == "simpo":
        chosen_r, rejected_r = beta * chosen_logps / n_c, beta * rejected_logps / n_r
        per_pair = _smoothed(chosen_r - rejected_r - simpo_gamma, label_smoothing)
    elif loss == "orpo":
        chosen_r, rejected_r = log_odds(chosen_logps / n_c), log_odds(rejected_logps / n_r)
        or_term = -F.logsigmoid(chosen_r - rejected_r)
        per_pair = -chosen_logps / n_c + orpo_lambda * or_term
        extra["orpo/or_loss"] = or_term.detach()
    else:
        if ref_chosen_logps is None or ref_rejected_logps is None:
            raise ValueError(f"preference loss {loss!r} needs the reference log-probs")
        chosen_lr, rejected_lr = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
        chosen_r, rejected_r = beta * chosen_lr, beta * rejected_lr
        if loss == "sigmoid":
            per_pair = _smoothed(beta * (chosen_lr - rejected_lr), label_smoothing)
        elif loss == "kto":
            if kl_baseline is None:
                raise ValueError("preference loss 'kto' needs the KL baseline (kto_kl_baseline)")
            l_d, l_u, _ = kto_loss(chosen_logps, ref_chosen_logps, rejected_logps, ref_rejected_logps, kl_baseline,
                                   beta=beta, desirable_weight=kto_desirable_weight,
                                   undesirable_weight=kto_undesirable_weight)
            per_pair = 0.5 * (l_d + l_u)
            extra["kto/kl_baseline"] = kl_baseline.detach().expand_as(per_pair).to(per_pair.dtype)
        else:  # ipo
            per_pair = (chosen_lr / n_c - rejected_lr / n_r - 1.0 / (2.0 * beta)) ** 2
    nll = -chosen_logps / n_c
    if nll_coef:
        per_pair = per_pair + nll_coef * nll
    chosen_r, rejected_r = chosen_r.detach(), rejected_r.detach()
    metrics = {
        "rewards/chosen": chosen_r,
        "rewards/rejected": rejected_r,
        "rewards/margin": chosen_r - rejected_r,
        "rewards/accuracy": (chosen_r > rejected_r).to(chosen_r.dtype),
        "logps/chosen": chosen_logps.detach(),
        "logps/rejected": rejected_logps.detach(),
        "nll/chosen": nll.detach(),
        **extra,
    }
    return per_pair, metrics


def bradley_terry_loss(chosen_scores: torch.Tensor, rejected_scores: torch.Tensor
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss of each pair [B], per-pair metrics) of a reward model's scores (module docstring).

    Metrics, detached [B] each: ``accuracy`` (1.0 where the chosen answer scores higher), ``margin``
    (chosen minus rejected score), ``scores/chosen``, ``scores/rejected``."""
    diff = chosen_scores - rejected_scores
    metrics = {"accuracy": (diff > 0).to(diff.dtype).detach(), "margin": diff.detach(),
               "scores/chosen": chosen_scores.detach(), "scores/rejected": rejected_scores.detach()}
    return -F.logsigmoid(diff), metrics
