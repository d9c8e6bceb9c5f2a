"""Policy / value / LM losses against plain-Python loop references, properties and gradchecks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from algorithms import losses as losses_mod
from algorithms.aggregation import AGG_MODES
from algorithms.losses import (
    entropy_from_logits,
    lm_loss,
    logprobs_from_logits,
    masked_mean,
    policy_loss,
    value_loss,
)
from tests.helpers.references import agg_ref

SHAPES = [(1, 1), (3, 5), (6, 9)]
CLIPS = [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)]


# ------------------------------------------------------------------------------------ loop references


def pg_token_ref(lp, old, a, cl, ch, cc):
    log_ratio = min(max(lp - old, -20.0), 20.0)
    r = math.exp(log_ratio)
    l1, l2 = -a * r, -a * min(max(r, 1 - cl), 1 + ch)
    loss, clipped, dual = max(l1, l2), l2 > l1, False
    if cc is not None and a < 0:
        dual = loss > -a * cc
        loss = min(loss, -a * cc)
    return loss, clipped, dual, r, log_ratio


def masked_mean_ref(vals, mask):
    xs = [x for row, mr in zip(vals, mask) for x, m in zip(row, mr) if m]
    return sum(xs) / max(len(xs), 1)


def ragged_mask(b, t, gen):
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    lengths[0] = max(1, int(lengths[0]))
    return (torch.arange(t)[None] < lengths[:, None]).long()


def pg_inputs(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    lp = -torch.rand(shape, generator=gen, dtype=torch.float64) * 3
    old = lp + torch.randn(shape, generator=gen, dtype=torch.float64) * 0.4
    a = torch.randn(shape, generator=gen, dtype=torch.float64)
    return lp, old, a, ragged_mask(*shape, gen)


# -------------------------------------------------------------------------------------------- policy


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("clip", CLIPS)
def test_policy_loss_matches_loop(shape, mode, clip):
    cl, ch, cc = clip
    lp, old, a, m = pg_inputs(shape, seed=shape[0] * 10 + shape[1])
    loss, metrics = policy_loss(lp, old, a, m, clip_low=cl, clip_high=ch, clip_c=cc, agg_mode=mode)
    toks = [
        [pg_token_ref(x, y, z, cl, ch, cc) for x, y, z in zip(r1, r2, r3)]
        for r1, r2, r3 in zip(lp.tolist(), old.tolist(), a.tolist())
    ]
    mask = m.tolist()
    field = lambda i: [[tok[i] for tok in row] for row in toks]  # noqa: E731
    assert loss.item() == pytest.approx(agg_ref(field(0), mask, mode), rel=1e-9, abs=1e-12)
    assert metrics["clipfrac"].item() == pytest.approx(masked_mean_ref(field(1), mask))
    assert metrics["dual_clipfrac"].item() == pytest.approx(masked_mean_ref(field(2), mask))
    assert metrics["ratio_mean"].item() == pytest.approx(masked_mean_ref(field(3), mask))
    assert metrics["approx_kl"].item() == pytest.approx(-masked_mean_ref(field(4), mask))
    valid_ratios = [r for row, mr in zip(field(3), mask) for r, x in zip(row, mr) if x]
    assert metrics["ratio_max"].item() == pytest.approx(max(valid_ratios))
    assert metrics["ratio_min"].item() == pytest.approx(min(valid_ratios))
    for v in metrics.values():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad


def test_policy_loss_empty_mask_is_zero_and_finite():
    lp, old, a, m = pg_inputs((2, 3), 0)
    loss, metrics = policy_loss(lp, old, a, torch.zeros_like(m))
    assert loss.item() == 0.0
    assert all(torch.isfinite(v) for v in metrics.values())


def test_policy_loss_rejects_bad_clip():
    lp, old, a, m = pg_inputs((2, 3), 0)
    with pytest.raises(ValueError, match="clip_c"):
        policy_loss(lp, old, a, m, clip_c=1.0)
    with pytest.raises(ValueError, match="agg"):
        policy_loss(lp, old, a, m, agg_mode="mean")


@settings(max_examples=50, deadline=None)
@given(
    adv=st.lists(st.floats(-10, 10, allow_nan=False), min_size=1, max_size=12),
    mode=st.sampled_from(AGG_MODES),
)
def test_policy_loss_is_minus_advantage_at_ratio_one(adv, mode):
    a = torch.tensor([adv], dtype=torch.float64)
    lp = -torch.rand_like(a)
    m = torch.ones_like(a)
    loss, metrics = policy_loss(lp, lp.clone(), a, m, clip_low=0.2, clip_high=0.3, clip_c=3.0, agg_mode=mode)
    assert loss.item() == pytest.approx(agg_ref([[-x for x in adv]], [[1] * len(adv)], mode), abs=1e-12)
    assert metrics["clipfrac"].item() == 0.0 and metrics["ratio_mean"].item() == 1.0
    single, _ = policy_loss(lp[:, :1], lp[:, :1].clone(), a[:, :1], m[:, :1])
    assert single.item() == pytest.approx(-adv[0], abs=1e-12)


def _single_token_grad(log_ratio, a, cl, ch, cc=None):
    old = torch.tensor([[-1.0]], dtype=torch.float64)
    lp = (old + log_ratio).requires_grad_(True)
    loss, _ = policy_loss(lp, old, torch.tensor([[a]], dtype=torch.float64), torch.ones(1, 1), cl, ch, cc)
    loss.backward()
    return loss.item(), lp.grad.item()


@settings(max_examples=50, deadline=None)
@given(
    log_ratio=st.floats(-1.5, 1.5, allow_nan=False),
    a=st.floats(-5, 5, allow_nan=False).filter(lambda x: abs(x) > 1e-3),
    cl=st.floats(0.05, 0.4),
    ch=st.floats(0.05, 0.4),
)
def test_clipping_stops_gradient_on_the_advantage_side(log_ratio, a, cl, ch):
    r = math.exp(log_ratio)
    assume(abs(r - (1 + ch)) > 1e-6 and abs(r - (1 - cl)) > 1e-6)
    _, grad = _single_token_grad(log_ratio, a, cl, ch)
    if (a > 0 and r > 1 + ch) or (a < 0 and r < 1 - cl):
        assert grad == 0.0
    else:  # d/dlogp (-a * r) = -a * r
        assert grad == pytest.approx(-a * r, rel=1e-9)


@settings(max_examples=50, deadline=None)
@given(
    log_ratio=st.floats(-3, 3, allow_nan=False),
    a=st.floats(-5, -1e-3, allow_nan=False),
    cc=st.floats(1.5, 5.0),
)
def test_dual_clip_bounds_negative_advantage_loss(log_ratio, a, cc):
    r = math.exp(log_ratio)
    assume(abs(r - cc) > 1e-6 and abs(r - 0.8) > 1e-6)
    loss, grad = _single_token_grad(log_ratio, a, 0.2, 0.2, cc)
    assert loss <= cc * abs(a) + 1e-12
    if r > cc:  # bounded by the constant: no gradient
        assert grad == 0.0 and loss == pytest.approx(cc * abs(a))
    # without dual clip the loss is unbounded above
    unbounded, _ = _single_token_grad(log_ratio, a, 0.2, 0.2)
    assert unbounded >= loss - 1e-12


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("cc", [None, 3.0])
def test_policy_loss_gradcheck(mode, cc):
    lp, old, a, m = pg_inputs((3, 4), 7)
    lp.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: policy_loss(x, old, a, m, 0.2, 0.28, cc, agg_mode=mode, normalizer=5.0)[0], (lp,)
    )


# --------------------------------------------------------------------------------------------- value


def vf_token_ref(v, old, ret, cr):
    e1 = (v - ret) ** 2
    if cr is None:
        return 0.5 * e1, False
    vc = old + min(max(v - old, -cr), cr)
    e2 = (vc - ret) ** 2
    return 0.5 * max(e1, e2), e2 > e1


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("cr", [None, 0.2, 1.0])
def test_value_loss_matches_loop(shape, mode, cr):
    gen = torch.Generator().manual_seed(shape[1])
    v = torch.randn(shape, generator=gen, dtype=torch.float64)
    old = v + torch.randn(shape, generator=gen, dtype=torch.float64) * 0.5
    ret = torch.randn(shape, generator=gen, dtype=torch.float64)
    m = ragged_mask(*shape, gen)
    loss, metrics = value_loss(v, old, ret, m, clip_range=cr, agg_mode=mode)
    toks = [
        [vf_token_ref(*x, cr) for x in zip(*rows)] for rows in zip(v.tolist(), old.tolist(), ret.tolist())
    ]
    mask = m.tolist()
    assert loss.item() == pytest.approx(agg_ref([[t[0] for t in row] for row in toks], mask, mode), rel=1e-9)
    assert metrics["vf_clipfrac"].item() == pytest.approx(
        masked_mean_ref([[t[1] for t in row] for row in toks], mask)
    )
    assert metrics["vpred_mean"].item() == pytest.approx(masked_mean_ref(v.tolist(), mask))


def test_value_loss_gradcheck():
    gen = torch.Generator().manual_seed(3)
    v = torch.randn(3, 4, generator=gen, dtype=torch.float64).requires_grad_(True)
    old = v.detach() + torch.randn(3, 4, generator=gen, dtype=torch.float64) * 0.5
    ret = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    m = ragged_mask(3, 4, gen)
    for mode in AGG_MODES:
        assert torch.autograd.gradcheck(lambda x, md=mode: value_loss(x, old, ret, m, 0.2, md)[0], (v,))


# ----------------------------------------------------------------------------------- logits utilities


def log_softmax_ref(z):
    mx = max(z)
    lse = mx + math.log(sum(math.exp(x - mx) for x in z))
    return [x - lse for x in z]


@pytest.mark.parametrize("shape", [(1, 1, 2), (2, 3, 5), (3, 4, 11)])
def test_entropy_and_logprobs_match_loop(shape, monkeypatch):
    gen = torch.Generator().manual_seed(shape[-1])
    z = torch.randn(shape, generator=gen, dtype=torch.float64) * 3
    labels = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    exp_h, exp_lp = [], []
    for zrow, lrow in zip(z.tolist(), labels.tolist()):
        ls = [log_softmax_ref(pos) for pos in zrow]
        exp_h.append([-sum(math.exp(x) * x for x in pos) for pos in ls])
        exp_lp.append([pos[lab] for pos, lab in zip(ls, lrow)])
    for chunk in (1 << 24, 7):  # default chunking and one row per chunk
        monkeypatch.setattr(losses_mod, "_CHUNK_ELEMENTS", chunk)
        torch.testing.assert_close(entropy_from_logits(z), torch.tensor(exp_h, dtype=torch.float64))
        torch.testing.assert_close(logprobs_from_logits(z, labels), torch.tensor(exp_lp, dtype=torch.float64))


def test_logits_utilities_are_stable():
    z = torch.tensor([[[1e4, 0.0, -1e4], [50.0, 50.0, float("-inf")], [-1e4, -1e4, -1e4]]])
    h = entropy_from_logits(z)
    lp = logprobs_from_logits(z, torch.tensor([[0, 1, 2]]))
    assert torch.isfinite(h).all() and torch.isfinite(lp).all()
    torch.testing.assert_close(h, torch.tensor([[0.0, math.log(2), math.log(3)]]))
    # float32 logsumexp at |z| = 1e4 carries ~1e-4 absolute rounding (the same as log_softmax would)
    torch.testing.assert_close(lp, torch.tensor([[0.0, -math.log(2), -math.log(3)]]), atol=1e-3, rtol=0)
    zh = z.clone().requires_grad_(True)
    entropy_from_logits(zh).sum().backward()
    assert torch.isfinite(zh.grad).all()


def test_half_precision_logits_computed_in_float32():
    z = torch.randn(2, 3, 7).to(torch.bfloat16)
    labels = torch.randint(0, 7, (2, 3))
    lp = logprobs_from_logits(z, labels)
    assert lp.dtype == torch.float32 and entropy_from_logits(z).dtype == torch.float32
    expected = torch.log_softmax(z.float(), -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(lp, expected)


def test_logits_utilities_gradcheck():
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64).requires_grad_(True)
    labels = torch.randint(0, 5, (2, 3), generator=gen)
    assert torch.autograd.gradcheck(entropy_from_logits, (z,))
    assert torch.autograd.gradcheck(lambda x: logprobs_from_logits(x, labels), (z,))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_lm_loss_matches_loop(mode):
    gen = torch.Generator().manual_seed(11)
    z = torch.randn(4, 6, 9, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 9, (4, 6), generator=gen)
    labels[1, 2] = -100  # ignore id: masked out even where loss_mask is 1
    m = ragged_mask(4, 6, gen)
    m[1, 2] = 1
    nll, eff_mask = [], []
    for zrow, lrow, mrow in zip(z.tolist(), labels.tolist(), m.tolist()):
        nll.append([-log_softmax_ref(pos)[lab] if lab >= 0 else 0.0 for pos, lab in zip(zrow, lrow)])
        eff_mask.append([int(x and lab >= 0) for x, lab in zip(mrow, lrow)])
    assert lm_loss(z, labels, m, agg_mode=mode).item() == pytest.approx(
        agg_ref(nll, eff_mask, mode), rel=1e-9
    )
    full = lm_loss(z, labels.clamp_min(0))
    assert full.item() == pytest.approx(
        torch.nn.functional.cross_entropy(z.reshape(-1, 9), labels.clamp_min(0).reshape(-1)).item()
    )
    zg = z.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: lm_loss(x, labels, m, agg_mode=mode), (zg,))


def test_masked_mean_helper():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert masked_mean(x, m).item() == 1.5
    torch.testing.assert_close(masked_mean(x, m, dim=-1), torch.tensor([1.5, 0.0]))
