"""The old log-probs in the objective path (algorithms/objectives/behaviour.py): `objective_loss` with the
engine's log-probs applies the off-policy correction and reports the mismatch exactly as the driver's former
step did (correct the advantages and the mask of the whole batch, then the objective on the corrected batch),
bit for bit, and per micro-batch its metrics recombine into the whole batch's."""

from __future__ import annotations

import pytest
import torch

from algorithms import (
    IS_CORRECTIONS,
    ObjectiveInputs,
    global_normalizer,
    logprob_mismatch,
    rollout_correction,
)
from algorithms.objectives import BEHAVIOUR_MAX_METRICS, behaviour, behaviour_mask, objective_loss

OPTIONS = {"clip_low": 0.2, "clip_high": 0.28, "is_cap": 1.5, "is_low": 0.6, "is_high": 1.8}


def batch(seed: int = 0):
    """logp (a leaf), recomputed old logp, the engine's (an older policy's), advantages and a mask, float32."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(6, 9, generator=g) * 3
    roll = old + torch.randn(6, 9, generator=g) * 0.8
    roll[0] += 1.0  # a whole sequence far off (its geometric-mean ratio below the band)
    logp = (old + 0.1 * torch.randn(6, 9, generator=g)).requires_grad_(True)
    adv = torch.randn(6, 1, generator=g).expand(6, 9).clone()
    mask = (torch.rand(6, 9, generator=g) > 0.2).float()
    mask[2] = 0
    return logp, old, roll * mask, adv * mask, mask


def driver_path(name, logp, old, roll, adv, mask, kind, agg):
    """What the step did before: correct the whole batch, the objective on the corrected tensors."""
    weights, keep, om = rollout_correction(old, roll, mask, kind, cap=1.5, low=0.6, high=1.8)
    norm = global_normalizer(keep, agg)
    x = ObjectiveInputs(logp, old, adv * weights, keep, agg_mode=agg, normalizer=norm)
    return objective_loss(name, x, OPTIONS), om


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("kind", IS_CORRECTIONS)
def test_the_objective_path_corrects_as_the_driver_did_bit_for_bit(kind, agg, name):
    logp, old, roll, adv, mask = batch()
    (want, want_parts, want_m), om = driver_path(name, logp, old, roll, adv, mask, kind, agg)
    norm = global_normalizer(behaviour_mask(old, roll, mask, {**OPTIONS, "off_policy_correction": kind}), agg)
    x = ObjectiveInputs(logp, old, adv, mask, roll, agg, normalizer=norm)
    got, parts, m = objective_loss(name, x, {**OPTIONS, "off_policy_correction": kind})
    assert torch.equal(got, want) and torch.equal(parts["pg_loss"], want_parts["pg_loss"])
    g_got, g_want = (torch.autograd.grad(v, logp, retain_graph=True)[0] for v in (got, want))
    assert torch.equal(g_got, g_want)
    assert all(torch.equal(m[k], want_m[k]) for k in want_m)  # the objective's own metrics
    assert float(parts["tokens"]) == float(behaviour_mask(old, roll, mask, {**OPTIONS, "off_policy_correction": kind})
                                           .sum())
    mis = logprob_mismatch(roll, old, mask)
    assert {k: float(m[f"mismatch/{k}"]) for k in mis} == mis
    if kind == "none":
        assert not any(k.startswith("off_policy/") for k in m)
    else:
        assert {k: float(m[f"off_policy/{k}"]) for k in om} == om
    if kind.startswith("mis"):  # the band did drop tokens: the test compares a narrowed mask
        assert 0 < om["masked_fraction"] < 1


def test_without_the_engines_logprobs_nothing_changes():
    logp, old, _, adv, mask = batch(1)
    x = ObjectiveInputs(logp, old, adv, mask)
    out = behaviour(old, None, adv, mask, {"off_policy_correction": "mis_token"})
    assert out.advantages is adv and out.mask is mask and out.metrics == {}
    assert behaviour_mask(old, None, mask, {"off_policy_correction": "mis_token"}) is mask
    _, parts, m = objective_loss("ppo_clip", x, {"off_policy_correction": "tis"})
    assert "tokens" not in parts and not any("/" in k for k in m)


def test_micro_batch_metrics_recombine_into_the_batchs():
    """Token means weighted by each micro-batch's tokens and maxima (BEHAVIOUR_MAX_METRICS) give the whole
    batch's metrics, as the worker sums them."""
    logp, old, roll, adv, mask = batch(2)
    opts = {**OPTIONS, "off_policy_correction": "tis"}
    whole = behaviour(old, roll, adv, mask, opts).metrics
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    maxes: dict[str, float] = {}
    for rows in (slice(0, 2), slice(2, 4), slice(4, 6)):
        part = behaviour(old[rows], roll[rows], adv[rows], mask[rows], opts).metrics
        n = float(mask[rows].sum())
        for k, v in part.items():
            if k in BEHAVIOUR_MAX_METRICS:
                maxes[k] = max(maxes.get(k, -float("inf")), v) if n else maxes.get(k, -float("inf"))
            else:
                sums[k], weights[k] = sums.get(k, 0.0) + v * n, weights.get(k, 0.0) + n
    for k, v in whole.items():
        got = maxes[k] if k in BEHAVIOUR_MAX_METRICS else sums[k] / weights[k]
        assert got == pytest.approx(v, rel=1e-5), k
