"""Off-policy correction (algorithms/off_policy.py) against a per-token loop written from its definition."""

from __future__ import annotations

import math

import pytest
import torch

from algorithms import IS_CORRECTIONS, rollout_correction


def loop_reference(old, roll, mask, kind, cap, low, high):
    """Weights and keep mask, one token (or sequence) at a time."""
    b, r = old.shape
    w = [[0.0] * r for _ in range(b)]
    keep = [[0] * r for _ in range(b)]
    for i in range(b):
        toks = [j for j in range(r) if mask[i, j]]
        seq = math.exp(sum(float(old[i, j] - roll[i, j]) for j in toks) / max(len(toks), 1))
        for j in toks:
            rho = math.exp(float(old[i, j] - roll[i, j]))
            w[i][j] = min(rho, cap) if kind == "tis" else 1.0
            inside = {"mis_token": low <= rho <= high, "mis_sequence": low <= seq <= high}.get(kind, True)
            keep[i][j] = int(inside)
    return torch.tensor(w), torch.tensor(keep)


@pytest.mark.parametrize("kind", IS_CORRECTIONS)
def test_the_correction_equals_the_loop_reference(kind):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 9, generator=g) * 3
    roll = old + torch.randn(6, 9, generator=g) * 0.8  # some tokens far off (rho > 2 or < 0.5)
    mask = (torch.rand(6, 9, generator=g) > 0.2).long()
    mask[2] = 0  # an empty row
    w, keep, metrics = rollout_correction(old, roll, mask, kind, cap=1.5, low=0.6, high=1.8)
    ref_w, ref_keep = loop_reference(old, roll, mask, kind, 1.5, 0.6, 1.8)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-6)
    assert keep.dtype == mask.dtype and torch.equal(keep, ref_keep.to(mask.dtype))
    rho = torch.exp(old - roll)[mask.bool()]
    assert metrics["is_ratio_max"] == pytest.approx(float(rho.max()), rel=1e-6)
    assert metrics["capped_fraction"] == (pytest.approx(float((rho > 1.5).float().mean())) if kind == "tis" else 0.0)
    dropped = float(1 - ref_keep[mask.bool()].float().mean())
    assert metrics["masked_fraction"] == pytest.approx(dropped)
    if kind in ("tis", "mis_token"):  # the random ratios reach both sides of the cap and the band
        assert 0 < metrics["capped_fraction"] + metrics["masked_fraction"] < 1


def test_on_policy_samples_are_left_alone():
    old = -torch.rand(3, 4)
    mask = torch.ones(3, 4, dtype=torch.long)
    for kind in IS_CORRECTIONS:
        w, keep, m = rollout_correction(old, old.clone(), mask, kind)
        assert torch.equal(w, torch.ones(3, 4)) and torch.equal(keep, mask), kind
        assert m["is_ratio_mean"] == 1.0 and m["masked_fraction"] == 0.0 and m["capped_fraction"] == 0.0


def test_an_unknown_kind_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="tis, mis_token"):
        rollout_correction(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "clip")
