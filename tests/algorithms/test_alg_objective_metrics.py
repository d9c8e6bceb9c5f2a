"""The metrics only one objective logs (what tests/driver/test_objectives_e2e.py tells the objectives apart by),
against loops of their definitions: gmpo's `seq_ratio_mean` (each sequence's clipped geometric-mean ratio),
cispo's `is_weight_mean` (the clipped IS weights' token mean)."""

from __future__ import annotations

import math

import pytest
import torch

from algorithms import ObjectiveInputs, objective_loss

MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float64)
OWN = {"ppo_clip": "dual_clipfrac", "gspo": "seq_clipfrac", "gmpo": "seq_ratio_mean", "cispo": "is_weight_mean",
       "sapo": "gate_weight_mean"}


def data(seed: int):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(MASK.shape, generator=g, dtype=torch.float64) * 2
    logp = old + 0.5 * torch.randn(MASK.shape, generator=g, dtype=torch.float64)
    adv = torch.tensor([0.8, -1.2, 0.3, -0.4], dtype=torch.float64)[:, None].expand(MASK.shape).clone()
    return logp, old, adv


def metrics(name: str, seed: int, **options):
    logp, old, adv = data(seed)
    return objective_loss(name, ObjectiveInputs(logp, old, adv, MASK), options)[2], (logp, old, adv)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gmpo_seq_ratio_mean_is_the_clipped_geometric_mean(seed):
    m, (logp, old, adv) = metrics("gmpo", seed, clip_low=0.2, clip_high=0.3)
    values = []
    for i in range(MASK.shape[0]):
        toks = [t for t in range(MASK.shape[1]) if MASK[i, t]]
        if not toks:
            continue
        a = sum(float(adv[i, t]) for t in toks) / len(toks)
        sgn = math.copysign(1.0, a) if a else 0.0
        logs = []
        for t in toks:
            lr = float(logp[i, t] - old[i, t])
            logs.append(sgn * min(sgn * lr, sgn * min(max(lr, -0.2), 0.3)))
        values.append(math.exp(sum(logs) / len(toks)))
    assert float(m["seq_ratio_mean"]) == pytest.approx(sum(values) / len(values), rel=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cispo_is_weight_mean_is_the_clipped_ratios_mean(seed):
    m, (logp, old, _) = metrics("cispo", seed, clip_low=0.2, clip_high=0.28)
    ws = [min(max(math.exp(float(logp[i, t] - old[i, t])), 0.8), 1.28)
          for i in range(MASK.shape[0]) for t in range(MASK.shape[1]) if MASK[i, t]]
    assert float(m["is_weight_mean"]) == pytest.approx(sum(ws) / len(ws), rel=1e-12)
    assert 0.8 <= float(m["is_weight_mean"]) <= 1.28


def test_each_objectives_own_metric_is_its_alone():
    for name, key in OWN.items():
        got, _ = metrics(name, 0)
        assert key in got and not ({k for n, k in OWN.items() if n != name} & got.keys()), (name, sorted(got))
