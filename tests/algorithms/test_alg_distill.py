"""On-policy distillation's advantages and top-1 agreement (algorithms/distill.py), against a loop over the
positions written from the formula A_t = w_r * A_task_t + c * (log q(y_t) - log s(y_t))."""

from __future__ import annotations

import pytest
import torch

from algorithms import distill_advantages, top1_agreement


def _loop(task, s, q, mask, c, w):
    out = torch.zeros_like(task)
    for i in range(task.shape[0]):
        for t in range(task.shape[1]):
            if mask[i, t]:
                out[i, t] = w * task[i, t] + c * (q[i, t] - s[i, t])
    return out


@pytest.mark.parametrize(("c", "w"), [(1.0, 0.0), (0.5, 1.0), (0.0, 2.0)])
def test_advantages_equal_the_per_token_formula(c, w):
    g = torch.Generator().manual_seed(0)
    task, s, q = (torch.randn(4, 6, generator=g) for _ in range(3))
    mask = torch.rand(4, 6, generator=g) > 0.3
    adv, m = distill_advantages(task, s, q, mask, kl_coef=c, reward_weight=w)
    assert torch.allclose(adv, _loop(task, s, q, mask, c, w), atol=1e-6)
    kl = sum(float(s[i, t] - q[i, t]) for i in range(4) for t in range(6) if mask[i, t]) / int(mask.sum())
    assert m["distill/teacher_kl"] == pytest.approx(kl, abs=1e-5)


def test_a_teacher_equal_to_the_student_gives_zero_kl_and_leaves_the_task_advantage():
    s = torch.randn(3, 5)
    task = torch.randn(3, 5)
    mask = torch.ones(3, 5)
    adv, m = distill_advantages(task, s, s.clone(), mask, kl_coef=1.0, reward_weight=1.0)
    assert torch.allclose(adv, task)
    assert m["distill/teacher_kl"] == 0.0


def test_tokens_the_teacher_finds_likelier_get_positive_advantage():
    s = torch.tensor([[-2.0, -0.5]])
    q = torch.tensor([[-0.5, -2.0]])
    adv, _ = distill_advantages(torch.zeros(1, 2), s, q, torch.ones(1, 2))
    assert adv[0, 0] > 0 > adv[0, 1]


def test_no_gradient_flows_into_the_log_probs():
    s = torch.randn(2, 3, requires_grad=True)
    adv, _ = distill_advantages(torch.zeros(2, 3), s, torch.randn(2, 3), torch.ones(2, 3))
    assert not adv.requires_grad


def test_negative_weights_are_refused():
    with pytest.raises(ValueError, match="kl_coef=-1"):
        distill_advantages(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), kl_coef=-1)


def test_top1_agreement_counts_masked_positions_only():
    a = torch.tensor([[1, 2, 3], [4, 5, 6]])
    b = torch.tensor([[1, 0, 3], [4, 0, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert float(top1_agreement(a, b, mask)) == pytest.approx(3 / 4)


def test_the_baseline_centres_the_distillation_term_over_the_masked_tokens():
    g = torch.Generator().manual_seed(1)
    s, q = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]])
    plain, _ = distill_advantages(torch.zeros(3, 4), s, q, mask)
    centred, m = distill_advantages(torch.zeros(3, 4), s, q, mask, baseline=True)
    gaps = [float(q[i, t] - s[i, t]) for i in range(3) for t in range(4) if mask[i, t]]
    mean = sum(gaps) / len(gaps)
    for i in range(3):
        for t in range(4):
            want = float(q[i, t] - s[i, t]) - mean if mask[i, t] else 0.0
            assert float(centred[i, t]) == pytest.approx(want, abs=1e-6)
    assert float(centred[mask.bool()].sum()) == pytest.approx(0.0, abs=1e-5)
    assert m["distill/teacher_kl"] == pytest.approx(-mean, abs=1e-6)  # the KL metric is the same either way
    assert not torch.allclose(plain, centred)
