"""Advantage estimators against plain-Python loop references, plus properties and registry behaviour."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from algorithms import advantages as adv_mod
from algorithms.advantages import (
    compute_advantages,
    get_advantage_estimator,
    list_advantage_estimators,
    register_advantage_estimator,
)

SHAPES = [(1, 1), (2, 3), (5, 7), (8, 16)]
WHITEN_EPS = 1e-8


# ------------------------------------------------------------------------------------ loop references


def whiten_ref(values: list[list[float]], mask: list[list[int]]) -> list[list[float]]:
    flat = [x for row, mrow in zip(values, mask) for x, m in zip(row, mrow) if m]
    n = len(flat)
    mean = sum(flat) / n if n else 0.0
    var = sum((x - mean) ** 2 for x in flat) / (n - 1) if n > 1 else 0.0
    scale = 1.0 / math.sqrt(var + WHITEN_EPS)
    return [[(x - mean) * scale if m else 0.0 for x, m in zip(row, mrow)] for row, mrow in zip(values, mask)]


def gae_ref(r, v, mask, gamma, lam):
    adv, ret = [], []
    for rr, vv, mm in zip(r, v, mask):
        idx = [t for t, m in enumerate(mm) if m]
        a_row, g_row = [0.0] * len(mm), [0.0] * len(mm)
        last = 0.0
        for k in range(len(idx) - 1, -1, -1):
            t = idx[k]
            nv = vv[idx[k + 1]] if k + 1 < len(idx) else 0.0
            delta = rr[t] + gamma * nv - vv[t]
            last = delta + gamma * lam * last
            a_row[t] = last
            g_row[t] = last + vv[t]
        adv.append(a_row)
        ret.append(g_row)
    return adv, ret


def scores_ref(r, mask):
    return [sum(x for x, m in zip(row, mrow) if m) for row, mrow in zip(r, mask)]


def groups_ref(ids):
    groups: dict = {}
    for i, g in enumerate(ids):
        groups.setdefault(g, []).append(i)
    return groups


def broadcast(a, mask):
    return [[a_b if m else 0.0 for m in mrow] for a_b, mrow in zip(a, mask)]


def grpo_ref(r, mask, ids, norm_by_std, eps=1e-6):
    s = scores_ref(r, mask)
    out = [0.0] * len(s)
    for members in groups_ref(ids).values():
        n = len(members)
        if n < 2:
            continue
        mean = sum(s[i] for i in members) / n
        std = math.sqrt(sum((s[i] - mean) ** 2 for i in members) / (n - 1))
        for i in members:
            out[i] = (s[i] - mean) / (std + eps) if norm_by_std else s[i] - mean
    return broadcast(out, mask)


def rloo_ref(r, mask, ids):
    s = scores_ref(r, mask)
    out = [0.0] * len(s)
    for members in groups_ref(ids).values():
        if len(members) < 2:
            continue
        for i in members:
            others = [s[j] for j in members if j != i]
            out[i] = s[i] - sum(others) / len(others)
    return broadcast(out, mask)


def rpp_ref(r, mask, gamma):
    ret = []
    for rr, mm in zip(r, mask):
        row = [0.0] * len(mm)
        g = 0.0
        for t in range(len(mm) - 1, -1, -1):
            if mm[t]:
                g = rr[t] + gamma * g
                row[t] = g
        ret.append(row)
    return whiten_ref(ret, mask), ret


def rpp_baseline_ref(r, mask, ids):
    s = scores_ref(r, mask)
    centered = [0.0] * len(s)
    for members in groups_ref(ids).values():
        if len(members) < 2:
            continue
        mean = sum(s[i] for i in members) / len(members)
        for i in members:
            centered[i] = s[i] - mean
    return whiten_ref(broadcast(centered, mask), mask)


# ------------------------------------------------------------------------------------------ inputs


def make_mask(b, t, gen, kind):
    if kind == "full":
        return torch.ones(b, t, dtype=torch.long)
    if kind == "ragged":  # right padding, some rows possibly empty
        lengths = torch.randint(0, t + 1, (b,), generator=gen)
        lengths[0] = max(1, int(lengths[0]))  # at least one token in the batch
        return (torch.arange(t)[None, :] < lengths[:, None]).long()
    m = (torch.rand(b, t, generator=gen) < 0.6).long()  # interleaved holes (multi-turn)
    m[0, 0] = 1
    return m


def make_groups(b, rng):
    """Group ids with a mix of sizes 1, 2 and 3, shuffled."""
    ids, g = [], 0
    while len(ids) < b:
        size = rng.choice([1, 2, 3])
        ids.extend([g] * size)
        g += 1
    ids = ids[:b]
    rng.shuffle(ids)
    return ids


def batch(shape, kind, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    b, t = shape
    r = torch.randn(b, t, generator=gen, dtype=dtype)
    v = torch.randn(b, t, generator=gen, dtype=dtype)
    m = make_mask(b, t, gen, kind)
    ids = make_groups(b, random.Random(seed))
    return r, v, m, ids


def tl(x):
    return x.tolist()


def assert_close(actual: torch.Tensor, expected, atol=1e-9, rtol=1e-7):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=rtol)


CASES = [(s, k, seed) for s in SHAPES for k in ("full", "ragged", "holes") for seed in (0, 1)]


# ------------------------------------------------------------------------------------ vs references


@pytest.mark.parametrize("shape,kind,seed", CASES)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_matches_loop(shape, kind, seed, gamma, lam):
    r, v, m, _ = batch(shape, kind, seed)
    exp_adv, exp_ret = gae_ref(tl(r), tl(v), tl(m), gamma, lam)
    adv, ret = get_advantage_estimator("gae")(
        token_level_rewards=r, values=v, response_mask=m, gamma=gamma, lam=lam, whiten_advantages=False
    )
    assert_close(adv, exp_adv)
    assert_close(ret, exp_ret)
    adv_w, ret_w = get_advantage_estimator("gae")(
        token_level_rewards=r, values=v, response_mask=m, gamma=gamma, lam=lam
    )
    assert_close(adv_w, whiten_ref(exp_adv, tl(m)), atol=1e-6, rtol=1e-6)
    assert_close(ret_w, exp_ret)


@pytest.mark.parametrize("shape,kind,seed", CASES)
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_loop(shape, kind, seed, norm_by_std):
    r, _, m, ids = batch(shape, kind, seed)
    adv, ret = compute_advantages(
        "grpo", token_level_rewards=r, response_mask=m, group_ids=ids, norm_by_std=norm_by_std
    )
    expected = grpo_ref(tl(r), tl(m), ids, norm_by_std)
    assert_close(adv, expected)
    assert_close(ret, expected)


@pytest.mark.parametrize("shape,kind,seed", CASES)
def test_rloo_matches_loop(shape, kind, seed):
    r, _, m, ids = batch(shape, kind, seed)
    adv, ret = compute_advantages("rloo", token_level_rewards=r, response_mask=m, index=ids)
    expected = rloo_ref(tl(r), tl(m), ids)
    assert_close(adv, expected)
    assert_close(ret, expected)


@pytest.mark.parametrize("shape,kind,seed", CASES)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_loop(shape, kind, seed, gamma):
    r, _, m, _ = batch(shape, kind, seed)
    adv, ret = compute_advantages("reinforce_plus_plus", token_level_rewards=r, response_mask=m, gamma=gamma)
    exp_adv, exp_ret = rpp_ref(tl(r), tl(m), gamma)
    assert_close(adv, exp_adv, atol=1e-6, rtol=1e-6)
    assert_close(ret, exp_ret)


@pytest.mark.parametrize("shape,kind,seed", CASES)
def test_reinforce_plus_plus_baseline_matches_loop(shape, kind, seed):
    r, _, m, ids = batch(shape, kind, seed)
    adv, ret = compute_advantages(
        "reinforce_plus_plus_baseline", token_level_rewards=r, response_mask=m, group_ids=torch.tensor(ids)
    )
    expected = rpp_baseline_ref(tl(r), tl(m), ids)
    assert_close(adv, expected, atol=1e-6, rtol=1e-6)
    assert_close(ret, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "name", ["gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]
)
def test_uniform_convention_float32_zero_outside_mask(name):
    """Every estimator takes the same full set of keywords and returns [B, T] zero outside the mask."""
    r, v, m, ids = batch((6, 9), "holes", 3, dtype=torch.float32)
    r[m == 0] = 100.0  # rewards outside the mask are ignored
    kwargs = dict(
        token_level_rewards=r,
        response_mask=m,
        values=v,
        group_ids=ids,
        gamma=0.99,
        lam=0.95,
        norm_by_std=True,
        eps=1e-6,
        whiten_advantages=True,
    )
    adv, ret = get_advantage_estimator(name)(**kwargs)
    assert adv.shape == ret.shape == r.shape
    assert adv.dtype == torch.float32
    assert torch.all(adv[m == 0] == 0) and torch.all(ret[m == 0] == 0)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert adv.abs().max() < 50  # the 100s outside the mask did not leak in
    assert not adv.requires_grad


def test_group_ids_forms_agree():
    r, _, m, ids = batch((7, 4), "ragged", 5)
    names = [f"uid-{i}" for i in ids]
    a1, _ = compute_advantages("grpo", token_level_rewards=r, response_mask=m, group_ids=ids)
    a2, _ = compute_advantages("grpo", token_level_rewards=r, response_mask=m, index=names)
    a3, _ = compute_advantages(
        "grpo", token_level_rewards=r, response_mask=m, group_ids=torch.tensor(ids) * 7
    )
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(a1, a3)


def test_group_of_size_one_gets_zero():
    r = torch.tensor([[1.0, 2.0], [3.0, 0.0], [5.0, 0.0]])
    m = torch.ones(2, 2).new_tensor([[1, 1], [1, 0], [1, 0]])
    for name in ("grpo", "rloo"):
        adv, _ = compute_advantages(name, token_level_rewards=r, response_mask=m, group_ids=[0, 1, 1])
        assert torch.all(adv[0] == 0)
    adv, _ = compute_advantages("grpo", token_level_rewards=r, response_mask=m, group_ids=[0, 1, 1])
    # group {3, 5}: mean 4, unbiased std sqrt(2)
    torch.testing.assert_close(adv[1:, 0], torch.tensor([-1.0, 1.0]) / (math.sqrt(2) + 1e-6))


# ------------------------------------------------------------------------------------------ properties

rows = st.integers(1, 6)
cols = st.integers(1, 8)


@settings(max_examples=50, deadline=None)
@given(b=rows, t=cols, seed=st.integers(0, 10_000))
def test_gae_lambda1_gamma1_is_reward_to_go_minus_value(b, t, seed):
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(b, t, generator=gen, dtype=torch.float64)
    v = torch.randn(b, t, generator=gen, dtype=torch.float64)
    m = make_mask(b, t, gen, "ragged")
    adv, ret = compute_advantages(
        "gae", token_level_rewards=r, values=v, response_mask=m, gamma=1.0, lam=1.0, whiten_advantages=False
    )
    mf = m.double()
    rtg = torch.flip(torch.cumsum(torch.flip(r * mf, [1]), 1), [1])
    torch.testing.assert_close(adv, (rtg - v) * mf)
    torch.testing.assert_close(ret, rtg * mf)


@settings(max_examples=50, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    t=cols,
    norm_by_std=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_grpo_sums_to_zero_within_groups(sizes, t, norm_by_std, seed):
    ids = [g for g, n in enumerate(sizes) for _ in range(n)]
    random.Random(seed).shuffle(ids)
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(len(ids), t, generator=gen, dtype=torch.float64)
    m = torch.ones(len(ids), t)
    adv, _ = compute_advantages(
        "grpo", token_level_rewards=r, response_mask=m, group_ids=ids, norm_by_std=norm_by_std
    )
    per_seq = adv[:, 0]
    assert torch.allclose(adv, per_seq[:, None].expand_as(adv))
    for g in set(ids):
        members = torch.tensor([i for i, x in enumerate(ids) if x == g])
        assert abs(per_seq[members].sum().item()) < 1e-8


@settings(max_examples=30, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6), seed=st.integers(0, 10_000))
def test_rloo_sums_to_zero_within_groups(sizes, seed):
    ids = [g for g, n in enumerate(sizes) for _ in range(n)]
    r = torch.randn(len(ids), 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    adv, _ = compute_advantages(
        "rloo", token_level_rewards=r, response_mask=torch.ones(len(ids), 3), group_ids=ids
    )
    for g in set(ids):
        assert abs(adv[[i for i, x in enumerate(ids) if x == g], 0].sum().item()) < 1e-8


# -------------------------------------------------------------------------------------------- registry


def test_unknown_estimator_lists_known_names():
    with pytest.raises(ValueError) as info:
        get_advantage_estimator("ppo2")
    for name in ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        assert name in str(info.value)
    assert set(list_advantage_estimators()) >= {"gae", "grpo", "rloo"}


def test_unknown_keyword_and_missing_inputs():
    r, v, m, ids = batch((3, 4), "full", 0)
    with pytest.raises(TypeError, match="lamda"):
        compute_advantages("gae", token_level_rewards=r, values=v, response_mask=m, lamda=0.9)
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("grpo", token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="group ids"):
        compute_advantages("grpo", token_level_rewards=r, response_mask=m, group_ids=[0, 0])
    with pytest.raises(ValueError):
        compute_advantages("grpo", token_level_rewards=r, response_mask=m[:, :2], group_ids=ids)
    with pytest.raises(TypeError, match="not both"):
        compute_advantages("grpo", token_level_rewards=r, response_mask=m, group_ids=ids, index=ids)


def test_register_custom_estimator(monkeypatch):
    monkeypatch.setattr(adv_mod, "_REGISTRY", dict(adv_mod._REGISTRY))

    @register_advantage_estimator("constant", extra_kwargs=("value",))
    def constant(*, token_level_rewards, response_mask, value=1.0, group_ids=None, **_):
        a = torch.full_like(token_level_rewards, value) * response_mask
        return a, a

    r, _, m, ids = batch((2, 3), "ragged", 1)
    adv, _ = get_advantage_estimator("constant")(token_level_rewards=r, response_mask=m, value=2.0, index=ids)
    assert torch.all(adv == 2.0 * m)
    with pytest.raises(ValueError, match="already registered"):
        register_advantage_estimator("constant")(constant)


# ------------------------------------------------------------------------------------- equal scores

GROUPED = ("grpo", "rloo", "reinforce_plus_plus_baseline")


@pytest.mark.parametrize("name", GROUPED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("value", [2.2, 0.1, -7.3, 1e-3])
def test_group_of_equal_scores_gets_exactly_zero(name, dtype, value):
    """16 samples that all scored 2.2: float32 statistics left a std of ~1e-7 and advantages of ~0.19."""
    r = torch.zeros(16, 4, dtype=dtype)
    r[:, -1] = value
    m = torch.ones(16, 4, dtype=torch.long)
    m[::3, 2:] = 0  # the score sits on different tokens of different rows
    r[::3, 1] = value
    adv, ret = compute_advantages(name, token_level_rewards=r, response_mask=m, group_ids=[0] * 16)
    assert torch.count_nonzero(adv) == 0 and torch.count_nonzero(ret) == 0


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_equal_group_is_zero_next_to_a_varied_group(norm_by_std):
    """Only the all-equal group is zeroed; the other group keeps the reference advantage."""
    scores = [2.2] * 8 + [0.3, 1.7, 2.2, 0.0, 1.0, 0.5, 2.9, 0.3]
    r = torch.tensor(scores, dtype=torch.float32).unsqueeze(-1)
    m = torch.ones_like(r, dtype=torch.long)
    ids = [0] * 8 + [1] * 8
    adv, _ = compute_advantages(
        "grpo", token_level_rewards=r, response_mask=m, group_ids=ids, norm_by_std=norm_by_std
    )
    assert torch.count_nonzero(adv[:8]) == 0
    expected = grpo_ref(tl(r.double()), tl(m), ids, norm_by_std)[8:]
    assert_close(adv[8:], expected, atol=1e-6, rtol=1e-6)
    adv, _ = compute_advantages("rloo", token_level_rewards=r, response_mask=m, group_ids=ids)
    assert torch.count_nonzero(adv[:8]) == 0
    assert_close(adv[8:], rloo_ref(tl(r.double()), tl(m), ids)[8:], atol=1e-6, rtol=1e-6)


def test_group_statistics_are_float64():
    """A spread far below float32's resolution at 1e4 still gives the exact float64 advantage."""
    r = torch.tensor([[1e4], [1e4 + 1e-3]], dtype=torch.float64)
    m = torch.ones(2, 1)
    adv, _ = compute_advantages("grpo", token_level_rewards=r, response_mask=m, group_ids=[0, 0], eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([[-1.0], [1.0]], dtype=torch.float64) / math.sqrt(2))
