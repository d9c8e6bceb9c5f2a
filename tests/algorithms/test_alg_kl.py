"""KL estimators, KL controllers and the KL reward penalty."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algorithms.kl import (
    KL_ALIASES,
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    canonical_kl_kind,
    kl_estimate,
    make_kl_controller,
)


def kl_ref(lp: float, ref: float, kind: str) -> float:
    d = lp - ref
    if kind in ("k1", "kl"):
        return d
    if kind in ("k2", "mse"):
        return 0.5 * d * d
    if kind == "abs":
        return abs(d)
    x = min(max(ref - lp, -20.0), 20.0)
    return min(max(math.exp(x) - x - 1.0, -10.0), 10.0)


def loop_apply(fn, *tensors):
    rows = zip(*(t.tolist() for t in tensors))
    return [[fn(*vals) for vals in zip(*row)] for row in rows]


@pytest.mark.parametrize(
    "kind", ["k1", "k2", "k3", "abs", "low_var_kl", "mse", "kl", "k3+", "low_var_kl+", "k1+", "kl+"]
)
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (4, 17)])
def test_kl_estimate_matches_loop(kind, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    lp = -torch.rand(shape, generator=gen, dtype=torch.float64) * 5
    ref = -torch.rand(shape, generator=gen, dtype=torch.float64) * 5
    lp[0, 0], ref[0, 0] = -30.0, -1.0  # large gap: exercises the k3 clamps
    base = kind.rstrip("+").replace("low_var_kl", "k3")
    expected = loop_apply(lambda a, b: kl_ref(a, b, base), lp, ref)
    torch.testing.assert_close(kl_estimate(lp, ref, kind), torch.tensor(expected, dtype=torch.float64))


def test_k3_clamped_to_ten():
    out = kl_estimate(torch.tensor([-30.0]), torch.tensor([-1.0]), "k3")
    assert out.item() == 10.0


@settings(max_examples=50, deadline=None)
@given(
    x=st.lists(st.floats(-50, 0, allow_nan=False, width=32), min_size=1, max_size=16),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_kl_zero_when_equal(x, dtype):
    lp = torch.tensor(x, dtype=dtype)
    for kind in ("k1", "k2", "k3", "abs", "k3+"):
        assert torch.all(kl_estimate(lp, lp.clone(), kind) == 0), kind


@settings(max_examples=50, deadline=None)
@given(
    lp=st.lists(st.floats(-60, 0, allow_nan=False, width=32), min_size=1, max_size=16),
    shift=st.floats(-0.0009765625, 0.0009765625, allow_nan=False, width=32),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_k3_nonnegative(lp, shift, dtype):
    a = torch.tensor(lp, dtype=dtype)
    # small and large gaps (tiny differences are where exp(x) - x - 1 loses precision)
    for b in (a + shift, a.flip(0), a * 0.5):
        assert torch.all(kl_estimate(a, b, "k3") >= 0)
        assert torch.all(kl_estimate(a, b, "k3+") >= 0)
        assert torch.all(kl_estimate(a, b, "k2") >= 0)


def test_k3_plus_value_is_k3_gradient_is_k2():
    gen = torch.Generator().manual_seed(0)
    lp0 = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 3
    ref = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 3
    w = torch.rand(4, 6, generator=gen, dtype=torch.float64)
    grads = {}
    for kind in ("k2", "k3", "k3+"):
        lp = lp0.clone().requires_grad_(True)
        val = kl_estimate(lp, ref, kind)
        (val * w).sum().backward()
        grads[kind] = lp.grad
        if kind == "k3+":
            torch.testing.assert_close(val.detach(), kl_estimate(lp0, ref, "k3"))
    torch.testing.assert_close(grads["k3+"], grads["k2"])
    torch.testing.assert_close(grads["k2"], w * (lp0 - ref))  # d/dlogp 0.5 d^2 = d
    assert not torch.allclose(grads["k3"], grads["k2"])


def test_kl_gradcheck():
    gen = torch.Generator().manual_seed(1)
    lp = (-torch.rand(3, 4, generator=gen, dtype=torch.float64) * 2).requires_grad_(True)
    ref = -torch.rand(3, 4, generator=gen, dtype=torch.float64) * 2
    # not k3+: its gradient is deliberately not the derivative of its value
    for kind in ("k1", "k2", "k3", "abs"):
        assert torch.autograd.gradcheck(lambda x, k=kind: kl_estimate(x, ref, k), (lp,))


def test_unknown_kind():
    with pytest.raises(ValueError) as info:
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")
    for kind in ("k1", "k2", "k3", "abs", "k3+", "low_var_kl"):
        assert kind in str(info.value)
    assert "k3+" in KL_KINDS
    with pytest.raises(ValueError, match="full-vocabulary"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "full")


# verl's kl_penalty names and the values verl computes for them (core_algos.kl_penalty_forward)
VERL_NAMES = {"kl": "k1", "abs": "abs", "mse": "k2", "low_var_kl": "k3"}


@pytest.mark.parametrize("verl_name", sorted(VERL_NAMES))
@pytest.mark.parametrize("plus", ["", "+"])
def test_verl_names_are_accepted_with_the_same_meaning(verl_name, plus):
    ours = VERL_NAMES[verl_name] + plus
    assert verl_name + plus in KL_KINDS
    assert canonical_kl_kind(verl_name + plus) == ours
    gen = torch.Generator().manual_seed(3)
    lp = (-torch.rand(4, 6, generator=gen, dtype=torch.float64) * 4).requires_grad_(True)
    ref = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 4
    a, b = kl_estimate(lp, ref, verl_name + plus), kl_estimate(lp, ref, ours)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    (ga,) = torch.autograd.grad(a.sum(), lp)
    (gb,) = torch.autograd.grad(b.sum(), lp)
    torch.testing.assert_close(ga, gb, rtol=0, atol=0)


def test_every_kind_is_a_base_kind_an_alias_or_their_plus_form():
    bases = {canonical_kl_kind(k).rstrip("+") for k in KL_KINDS}
    assert bases == {"k1", "k2", "k3", "abs"}
    assert set(KL_ALIASES) <= set(KL_KINDS) and {k + "+" for k in KL_ALIASES} <= set(KL_KINDS)


# ------------------------------------------------------------------------------------------ controllers


def test_fixed_controller():
    c = make_kl_controller("fixed", 0.05)
    assert isinstance(c, FixedKLController)
    assert c.update(10.0, 256) == 0.05 and c.value == 0.05


def test_adaptive_controller_moves_beta_the_right_way():
    c = make_kl_controller("adaptive", 0.1, target=6.0, horizon=10_000)
    assert isinstance(c, AdaptiveKLController)
    c.update(12.0, 100)  # KL above target -> beta up, error clipped to +0.2
    assert c.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 10_000))
    before = c.value
    c.update(torch.tensor(3.0), 100)  # below target -> beta down, error -0.5 clipped to -0.2
    assert c.value == pytest.approx(before * (1 - 0.2 * 100 / 10_000))
    before = c.value
    c.update(6.6, 1000)  # small proportional error 0.1, not clipped
    assert c.value == pytest.approx(before * (1 + 0.1 * 1000 / 10_000))
    before = c.value
    c.update(6.0, 1000)  # on target: unchanged
    assert c.value == pytest.approx(before)


def test_adaptive_controller_loop_reference():
    c = AdaptiveKLController(0.2, target=1.0, horizon=500)
    beta = 0.2
    for kl in [0.0, 0.5, 1.0, 1.1, 2.0, 5.0, 0.9]:
        err = min(max(kl / 1.0 - 1.0, -0.2), 0.2)
        beta *= 1 + err * 64 / 500
        assert c.update(kl, 64) == pytest.approx(beta)


def test_controller_state_dict_round_trip():
    c = make_kl_controller("adaptive", 0.1, target=2.0, horizon=100)
    for kl in (5.0, 0.1, 3.0):
        c.update(kl, 10)
    state = c.state_dict()
    d = make_kl_controller("adaptive", 0.7, target=2.0, horizon=100)
    d.load_state_dict(state)
    assert d.value == c.value and d.state_dict() == state
    assert c.update(4.0, 10) == d.update(4.0, 10)

    f = make_kl_controller("fixed", 0.3)
    g = make_kl_controller("fixed", 0.0)
    g.load_state_dict(f.state_dict())
    assert g.value == 0.3
    with pytest.raises(ValueError):
        g.load_state_dict(state)  # adaptive state into a fixed controller


def test_make_kl_controller_errors():
    with pytest.raises(ValueError, match="target"):
        make_kl_controller("adaptive", 0.1, horizon=100)
    with pytest.raises(ValueError, match="horizon"):
        make_kl_controller("adaptive", 0.1, target=1.0)
    with pytest.raises(ValueError, match="fixed, adaptive"):
        make_kl_controller("pid", 0.1)


# ------------------------------------------------------------------------------------------ penalty


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (6, 8)])
def test_apply_kl_penalty_matches_loop(shape):
    gen = torch.Generator().manual_seed(shape[0])
    r = torch.randn(shape, generator=gen, dtype=torch.float64)
    kl = torch.rand(shape, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, shape[1] + 1, (shape[0],), generator=gen)
    lengths[0] = max(1, int(lengths[0]))
    m = (torch.arange(shape[1])[None] < lengths[:, None]).long()
    beta = 0.3
    out, kl_mean = apply_kl_penalty(r, kl, beta, m)
    exp_rows, seq_means = [], []
    for rr, kk, mm in zip(r.tolist(), kl.tolist(), m.tolist()):
        exp_rows.append([(a - beta * k) if x else 0.0 for a, k, x in zip(rr, kk, mm)])
        if sum(mm):
            seq_means.append(sum(k for k, x in zip(kk, mm) if x) / sum(mm))
    torch.testing.assert_close(out, torch.tensor(exp_rows, dtype=torch.float64))
    assert kl_mean.item() == pytest.approx(sum(seq_means) / len(seq_means))
    assert kl_mean.dim() == 0 and not kl_mean.requires_grad
