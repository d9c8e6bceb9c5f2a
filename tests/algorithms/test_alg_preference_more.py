"""ORPO (`preference_loss(loss="orpo")`) and KTO (`kto_loss`) against per-example loops of their papers'
equations (values and autograd gradients, float64), ORPO's odds-ratio term also against TRL's
`ORPOTrainer.odds_ratio_loss` when TRL is installed, and the edge cases of log(1 - p) near p = 1.

ORPO (Hong et al. 2024, eqs. 4-7): with p = exp(mean token log-prob of the answer), odds = p / (1 - p),
loss = NLL(chosen, averaged over its tokens) - lambda * log sigmoid(log(odds_chosen / odds_rejected)).
KTO (Ethayarajh et al. 2024, eq. 8): r = log pi(y|x) - log ref(y|x), z0 = max(0, mean over mismatched pairs of
the same log-ratio) with no gradient; desirable: lambda_D (1 - sigmoid(beta (r - z0))), undesirable:
lambda_U (1 - sigmoid(beta (z0 - r))).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from algorithms import (
    PREFERENCE_LOSSES,
    REFERENCE_FREE_LOSSES,
    kto_kl_baseline,
    kto_loss,
    log1mexp,
    log_odds,
    preference_loss,
)

B = 7


def _pairs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n_c = torch.randint(1, 9, (B,), generator=g)
    n_r = torch.randint(1, 9, (B,), generator=g)
    # summed log-probs with mean token log-probs from near 0 (p close to 1) to about -4
    c = -torch.rand(B, generator=g, dtype=torch.float64) * 4 * n_c
    r = -torch.rand(B, generator=g, dtype=torch.float64) * 4 * n_r
    return c, r, n_c, n_r


def _orpo_loop(c: torch.Tensor, r: torch.Tensor, n_c: torch.Tensor, n_r: torch.Tensor, lam: float) -> torch.Tensor:
    """The paper's loss pair by pair, in plain float math where the autograd graph allows it."""
    out = []
    for i in range(len(c)):
        p_c, p_r = torch.exp(c[i] / int(n_c[i])), torch.exp(r[i] / int(n_r[i]))
        odds_c, odds_r = p_c / (1 - p_c), p_r / (1 - p_r)
        nll = -c[i] / int(n_c[i])
        or_term = -torch.log(1 / (1 + 1 / (odds_c / odds_r)))  # -log sigmoid(log(odds ratio))
        out.append(nll + lam * or_term)
    return torch.stack(out)


@pytest.mark.parametrize("lam", [0.1, 1.0])
def test_orpo_equals_the_paper_loop(lam: float) -> None:
    c, r, n_c, n_r = _pairs(1)
    grads = []
    for fn in ("ours", "loop"):
        cc, rr = c.clone().requires_grad_(True), r.clone().requires_grad_(True)
        if fn == "ours":
            loss, m = preference_loss(cc, rr, None, None, n_c, n_r, loss="orpo", orpo_lambda=lam, beta=123.0)
        else:
            loss = _orpo_loop(cc, rr, n_c, n_r, lam)
        loss.sum().backward()
        grads.append((loss.detach(), cc.grad, rr.grad))
    (l1, gc1, gr1), (l2, gc2, gr2) = grads
    assert torch.allclose(l1, l2, atol=1e-10), (l1, l2)
    assert torch.allclose(gc1, gc2, atol=1e-10) and torch.allclose(gr1, gr2, atol=1e-10)
    lo_c = [math.log(math.exp(float(x) / int(n)) / (1 - math.exp(float(x) / int(n)))) for x, n in zip(c, n_c)]
    lo_r = [math.log(math.exp(float(x) / int(n)) / (1 - math.exp(float(x) / int(n)))) for x, n in zip(r, n_r)]
    assert m["rewards/chosen"].tolist() == pytest.approx(lo_c, abs=1e-9)
    assert m["rewards/rejected"].tolist() == pytest.approx(lo_r, abs=1e-9)
    margin = torch.tensor(lo_c, dtype=torch.float64) - torch.tensor(lo_r, dtype=torch.float64)
    assert torch.allclose(m["rewards/margin"], margin)
    assert torch.equal(m["rewards/accuracy"], (margin > 0).double())
    assert torch.allclose(m["orpo/or_loss"], -torch.nn.functional.logsigmoid(margin))
    assert torch.allclose(m["nll/chosen"], -c / n_c)
    assert torch.allclose(l1, m["nll/chosen"] + lam * m["orpo/or_loss"])


def test_orpo_odds_ratio_term_equals_trl() -> None:
    """TRL 1.16's `ORPOTrainer.odds_ratio_loss` takes the mean token log-probs and returns lambda x
    log sigmoid(log odds ratio) (its `beta` is the paper's lambda), to be subtracted from the NLL."""
    trl_orpo = pytest.importorskip("trl.experimental.orpo.orpo_trainer", reason="TRL is not installed")
    c, r, n_c, n_r = _pairs(2)
    self = SimpleNamespace(beta=0.3, accelerator=SimpleNamespace(device=torch.device("cpu")))
    a = torch.cat([c / n_c, r / n_r]).float().requires_grad_(True)
    trl_losses, *_ = trl_orpo.ORPOTrainer.odds_ratio_loss(self, *a.chunk(2))
    ours_in = a.detach().clone().requires_grad_(True)
    ones = torch.ones(B)
    loss, m = preference_loss(*ours_in.chunk(2), None, None, ones, ones, loss="orpo", orpo_lambda=0.3)
    (-trl_losses.sum()).backward()
    (loss + ours_in[:B]).sum().backward()  # the odds-ratio term alone: the NLL is -a_chosen (one token)
    assert torch.allclose(-trl_losses, 0.3 * m["orpo/or_loss"], atol=1e-6)
    assert torch.allclose(ours_in.grad, a.grad, atol=1e-6)


def test_log1mexp_is_stable_near_zero_and_far_below() -> None:
    x = torch.tensor([-1e-12, -1e-8, -1e-3, -0.5, -0.7, -1.0, -30.0, -800.0], dtype=torch.float64)
    want = [math.log(-math.expm1(v)) for v in x.tolist()]
    assert log1mexp(x).tolist() == pytest.approx(want, rel=1e-12)
    naive = torch.log(1 - torch.exp(x))  # loses the digits near 0: the reason for log1mexp
    assert abs(naive[0].item() - want[0]) > 1e-6
    x32 = torch.tensor([-1e-6, -1e-3, -5.0, -120.0], dtype=torch.float32, requires_grad=True)
    y = log1mexp(x32)
    y.sum().backward()
    assert y.tolist() == pytest.approx([math.log(-math.expm1(v)) for v in x32.tolist()], rel=1e-5)
    # d/dx log(1 - e^x) = -e^x / (1 - e^x) = 1 / expm1(-x) ... with the sign: -1 / expm1(-x)
    want_grad = [-1 / math.expm1(-v) for v in x32.tolist()]
    assert x32.grad is not None and x32.grad.tolist() == pytest.approx(want_grad, rel=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_orpo_is_finite_when_an_answer_is_certain(dtype: torch.dtype) -> None:
    """p = 1 (mean log-prob 0, or rounding to it) would make log(1 - p) = -inf; the mean log-prob is clamped
    to -eps of its dtype, so the loss and the gradients stay finite, with the odds capped near 1 / eps."""
    c = torch.tensor([0.0, -1e-30, 0.0, -3.0], dtype=dtype, requires_grad=True)
    r = torch.tensor([-2.0, 0.0, 0.0, -1e-9], dtype=dtype, requires_grad=True)
    n = torch.tensor([3, 1, 2, 4])
    loss, m = preference_loss(c, r, None, None, n, n, loss="orpo", orpo_lambda=1.0)
    loss.sum().backward()
    for t in (loss, m["rewards/chosen"], m["rewards/rejected"], c.grad, r.grad):
        assert t is not None and torch.isfinite(t).all(), t
    eps = torch.finfo(dtype).eps
    assert m["rewards/chosen"][0].item() == pytest.approx(math.log((1 - eps) / eps), rel=1e-3)
    assert m["rewards/margin"][2].item() == 0.0  # both certain: equal odds
    assert r.grad is not None and r.grad[1].item() == 0.0  # clamped: no gradient pushes p above 1 - eps
    assert torch.allclose(log_odds(torch.tensor([-math.log(2)], dtype=dtype)), torch.zeros(1, dtype=dtype))


def test_orpo_needs_no_reference_and_is_registered() -> None:
    assert "orpo" in PREFERENCE_LOSSES and set(REFERENCE_FREE_LOSSES) == {"simpo", "orpo"}
    c, r, n_c, n_r = _pairs(3)
    a, _ = preference_loss(c, r, None, None, n_c, n_r, loss="orpo")
    b, _ = preference_loss(c, r, c + 5, r - 5, n_c, n_r, loss="orpo")
    assert torch.equal(a, b)


# ---- KTO ----------------------------------------------------------------------------------------------------
def _kto_loop(d, d_ref, u, u_ref, kl, kl_ref, beta, lam_d, lam_u):
    """Eq. 8 example by example; z0 from the mismatched pairs, detached, clamped at 0."""
    z0 = max(0.0, sum(float(kl[i].detach() - kl_ref[i]) for i in range(len(kl))) / len(kl))
    loss_d = [lam_d * (1 - torch.sigmoid(beta * ((d[i] - d_ref[i]) - z0))) for i in range(len(d))]
    loss_u = [lam_u * (1 - torch.sigmoid(beta * (z0 - (u[i] - u_ref[i])))) for i in range(len(u))]
    return torch.stack(loss_d), torch.stack(loss_u), z0


@pytest.mark.parametrize("beta,lam_d,lam_u,kl_shift", [(0.1, 1.0, 1.0, 3.0), (0.5, 1.0, 1.33, 3.0),
                                                        (0.3, 0.8, 1.0, -3.0)])
def test_kto_equals_the_paper_loop(beta: float, lam_d: float, lam_u: float, kl_shift: float) -> None:
    """kl_shift < 0 makes the mismatched log-ratios negative on average: z0 clamps to 0."""
    g = torch.Generator().manual_seed(7)
    d, d_ref = -torch.rand(5, generator=g, dtype=torch.float64) * 20, -torch.rand(5, generator=g).double() * 20
    u, u_ref = -torch.rand(3, generator=g, dtype=torch.float64) * 20, -torch.rand(3, generator=g).double() * 20
    kl_ref = -torch.rand(8, generator=g, dtype=torch.float64) * 20
    kl = kl_ref + kl_shift + torch.randn(8, generator=g, dtype=torch.float64)
    results = []
    for fn in ("ours", "loop"):
        dd, uu, kk = d.clone().requires_grad_(True), u.clone().requires_grad_(True), kl.clone().requires_grad_(True)
        if fn == "ours":
            z0 = kto_kl_baseline(kk, kl_ref)
            ld, lu, m = kto_loss(dd, d_ref, uu, u_ref, z0, beta=beta, desirable_weight=lam_d,
                                 undesirable_weight=lam_u)
            assert not z0.requires_grad and m["kl_baseline"].item() == z0.item()
            assert torch.allclose(m["rewards/desirable"], beta * (d - d_ref))
        else:
            ld, lu, z = _kto_loop(dd, d_ref, uu, u_ref, kk, kl_ref, beta, lam_d, lam_u)
            if kl_shift < 0:
                assert z == 0.0
        (ld.sum() + lu.sum()).backward()
        results.append((ld.detach(), lu.detach(), dd.grad, uu.grad, kk.grad))
    (ld1, lu1, gd1, gu1, gk1), (ld2, lu2, gd2, gu2, gk2) = results
    assert torch.allclose(ld1, ld2, atol=1e-12) and torch.allclose(lu1, lu2, atol=1e-12)
    assert torch.allclose(gd1, gd2, atol=1e-12) and torch.allclose(gu1, gu2, atol=1e-12)
    assert gk1 is None and gk2 is None  # no gradient through the baseline
    assert (gd1 < 0).all() and (gu1 > 0).all()  # raise desirable, lower undesirable log-probs


def test_kto_baseline_edge_cases() -> None:
    empty = torch.zeros(0)
    assert kto_kl_baseline(empty, empty).item() == 0.0
    x = torch.tensor([1.0, 3.0])
    assert kto_kl_baseline(x, torch.zeros(2)).item() == 2.0
    assert kto_kl_baseline(-x, torch.zeros(2)).item() == 0.0
    ld, lu, _ = kto_loss(torch.zeros(2), torch.zeros(2), torch.zeros(1), torch.zeros(1), torch.tensor(0.0))
    assert torch.allclose(ld, torch.full((2,), 0.5)) and torch.allclose(lu, torch.full((1,), 0.5))


def test_kto_as_a_preference_loss_is_the_mean_over_the_split_examples() -> None:
    """`preference_loss(loss="kto")` on pairs: each pair a desirable and an undesirable example, so the pairs'
    summed loss over the pair count is the mean of `kto_loss` over the 2B examples (no term joins a pair)."""
    assert "kto" in PREFERENCE_LOSSES and "kto" not in REFERENCE_FREE_LOSSES
    c, r, n_c, n_r = _pairs(3)
    ref_c, ref_r = c.detach() - 1.5, r.detach() + 0.5
    z0 = torch.tensor(0.7, dtype=c.dtype)
    per_pair, m = preference_loss(c, r, ref_c, ref_r, n_c, n_r, loss="kto", beta=0.3, kl_baseline=z0,
                                  kto_desirable_weight=1.2, kto_undesirable_weight=0.9)
    ld, lu, _ = kto_loss(c, ref_c, r, ref_r, z0, beta=0.3, desirable_weight=1.2, undesirable_weight=0.9)
    assert torch.allclose(per_pair.sum() / len(per_pair), torch.cat([ld, lu]).mean(), atol=1e-12)
    assert torch.equal(m["kto/kl_baseline"], torch.full_like(per_pair, 0.7))
    assert torch.allclose(m["rewards/chosen"], 0.3 * (c - ref_c).detach())
