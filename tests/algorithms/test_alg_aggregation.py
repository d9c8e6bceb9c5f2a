"""Loss aggregation: loop references, the global normaliser, and micro-batch split invariance."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algorithms.aggregation import AGG_MODES, agg_loss, global_normalizer
from algorithms.losses import lm_loss, policy_loss, value_loss
from tests.helpers.references import agg_ref


def ragged_mask(b, t, gen, allow_empty=True):
    lengths = torch.randint(0 if allow_empty else 1, t + 1, (b,), generator=gen)
    lengths[0] = max(1, int(lengths[0]))
    return (torch.arange(t)[None] < lengths[:, None]).long()


@pytest.mark.parametrize("shape", [(1, 1), (2, 5), (7, 9)])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("normalizer,horizon", [(None, None), (3.0, None), (None, 12), (5.0, 4)])
def test_agg_loss_matches_loop(shape, mode, normalizer, horizon):
    gen = torch.Generator().manual_seed(shape[0])
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    m = ragged_mask(*shape, gen)
    out = agg_loss(x, m, mode, normalizer=normalizer, horizon=horizon)
    assert out.dim() == 0
    assert out.item() == pytest.approx(agg_ref(x.tolist(), m.tolist(), mode, normalizer, horizon), rel=1e-12)


def test_agg_loss_errors_and_empty():
    x = torch.ones(2, 3)
    with pytest.raises(ValueError) as info:
        agg_loss(x, torch.ones(2, 3), "mean")
    for mode in AGG_MODES:
        assert mode in str(info.value)
    with pytest.raises(ValueError, match="match"):
        agg_loss(x, torch.ones(2, 2))
    for mode in AGG_MODES:
        assert agg_loss(x, torch.zeros(2, 3), mode).item() == 0.0
        assert (
            agg_loss(x, torch.zeros(2, 3), mode, normalizer=global_normalizer(torch.zeros(2, 3), mode)).item()
            == 0.0
        )


def test_agg_loss_gradcheck():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, generator=gen, dtype=torch.float64).requires_grad_(True)
    m = ragged_mask(4, 5, gen)
    for mode in AGG_MODES:
        assert torch.autograd.gradcheck(lambda t, md=mode: agg_loss(t, m, md, normalizer=3.0), (x,))


def test_global_normalizer_counts():
    m = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0], [1, 1, 1]])
    assert global_normalizer(m, "token-mean").item() == 6
    assert global_normalizer(m, "token-sum").item() == 1
    for mode in [md for md in AGG_MODES if md.startswith("seq-mean")]:
        assert global_normalizer(m, mode).item() == 3  # the all-padding row is not a sequence
    # a list of micro-batch masks, possibly trimmed to different lengths, gives the same count
    parts = [m[:2, :2], m[2:, :]]
    for mode in AGG_MODES:
        assert global_normalizer(parts, mode).item() == global_normalizer(m, mode).item()
    assert global_normalizer(m, "token-mean").dtype == torch.float32
    with pytest.raises(ValueError):
        global_normalizer(m, "nope")
    with pytest.raises(ValueError):
        global_normalizer([], "token-mean")


# ------------------------------------------------------------------------------------ split invariance


def _split_rows(b, n_micro):
    return [idx for idx in torch.tensor_split(torch.arange(b), n_micro) if idx.numel()]


def _trim(mask_rows):
    """Right-trim a micro-batch to its longest valid row (what a packing worker does)."""
    nz = mask_rows.nonzero()
    return int(nz[:, 1].max()) + 1 if nz.numel() else 1


def _pg_loss_and_grad(lp0, old, adv, mask, mode, n_micro, trim, horizon):
    """Sum of micro-batch losses and the gradient wrt logp, using the global normaliser."""
    lp = lp0.clone().requires_grad_(True)
    norm = global_normalizer(mask, mode) if n_micro else None
    total = torch.zeros((), dtype=lp.dtype)
    for idx in _split_rows(lp.shape[0], max(n_micro, 1)):
        t = _trim(mask[idx]) if trim else lp.shape[1]
        loss, _ = policy_loss(
            lp[idx, :t], old[idx, :t], adv[idx, :t], mask[idx, :t], 0.2, 0.28, 3.0,
            agg_mode=mode, normalizer=norm, horizon=horizon,
        )  # fmt: skip
        loss.backward()
        total = total + loss.detach()
    return total, lp.grad


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("n_micro", [1, 2, 4])
@pytest.mark.parametrize("trim", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_policy_gradient_split_invariance(mode, n_micro, trim, seed):
    gen = torch.Generator().manual_seed(seed)
    b, t = 7, 10  # 7 rows: uneven micro-batches (2, 2, 2, 1 for n_micro=4)
    lp = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 3
    old = lp + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.4
    adv = torch.randn(b, t, generator=gen, dtype=torch.float64)
    mask = ragged_mask(b, t, gen)
    horizon = t  # explicit: trimmed micro-batches have different widths
    full_loss, full_grad = _pg_loss_and_grad(lp, old, adv, mask, mode, 0, False, horizon)
    split_loss, split_grad = _pg_loss_and_grad(lp, old, adv, mask, mode, n_micro, trim, horizon)
    torch.testing.assert_close(split_loss, full_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(split_grad, full_grad, rtol=1e-12, atol=1e-14)


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 9),
    t=st.integers(1, 8),
    n_micro=st.sampled_from([1, 2, 4]),
    mode=st.sampled_from(AGG_MODES),
    seed=st.integers(0, 10_000),
)
def test_value_and_lm_loss_split_invariance(b, t, n_micro, mode, seed):
    gen = torch.Generator().manual_seed(seed)
    mask = ragged_mask(b, t, gen)
    v0 = torch.randn(b, t, generator=gen, dtype=torch.float64)
    old = v0 + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.3
    ret = torch.randn(b, t, generator=gen, dtype=torch.float64)
    z0 = torch.randn(b, t, 5, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 5, (b, t), generator=gen)
    norm = global_normalizer(mask, mode)

    def run(parts, normalizer):
        v, z = v0.clone().requires_grad_(True), z0.clone().requires_grad_(True)
        for idx in parts:
            value_loss(v[idx], old[idx], ret[idx], mask[idx], 0.2, mode, normalizer=normalizer)[0].backward()
            lm_loss(z[idx], labels[idx], mask[idx], mode, normalizer=normalizer).backward()
        return v.grad, z.grad

    full = run([torch.arange(b)], None)
    split = run(_split_rows(b, n_micro), norm)
    for a, e in zip(split, full):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-14)


def test_without_normaliser_micro_means_are_not_the_global_mean():
    """Documents why the normaliser exists: a mean of micro-batch token-means is biased."""
    x = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    full = agg_loss(x, m, "token-mean")
    naive = (agg_loss(x[:1], m[:1], "token-mean") + agg_loss(x[1:], m[1:], "token-mean")) / 2
    norm = global_normalizer(m, "token-mean")
    right = agg_loss(x[:1], m[:1], normalizer=norm) + agg_loss(x[1:], m[1:], normalizer=norm)
    assert full.item() == pytest.approx(7 / 4) and naive.item() == pytest.approx(5 / 2)
    assert right.item() == pytest.approx(full.item())


def test_token_sum_is_verl_token_sum_and_ignores_the_normaliser():
    """verl's token-sum: ``(loss_mat * mask).sum()``; an all-reduced N (here DP=4) must not change it."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    m = ragged_mask(5, 6, gen)
    expected = (x * m).sum()
    torch.testing.assert_close(agg_loss(x, m, "token-sum"), expected)
    dp_summed = global_normalizer(m, "token-sum") * 4
    parts = [agg_loss(x[i : i + 2], m[i : i + 2], "token-sum", normalizer=dp_summed) for i in range(0, 5, 2)]
    torch.testing.assert_close(sum(parts), expected)
    # unlike token-mean, the loss grows with the number of tokens
    doubled = agg_loss(torch.cat([x, x]), torch.cat([m, m]), "token-sum")
    torch.testing.assert_close(doubled, 2 * expected)
    assert agg_loss(torch.cat([x, x]), torch.cat([m, m]), "token-mean").item() == pytest.approx(
        agg_loss(x, m, "token-mean").item()
    )
