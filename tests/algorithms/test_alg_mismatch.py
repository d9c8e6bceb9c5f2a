"""Training-inference mismatch metrics (algorithms/mismatch.py)."""

from __future__ import annotations

import math

import torch

from algorithms.mismatch import logprob_mismatch, routing_disagreement, routing_disagreement_metrics


def test_values_over_masked_tokens_only():
    rollout = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.1, -9.0]])
    policy = torch.tensor([[-1.1, -2.0, -2.5], [-0.5, -0.3, 0.0]])  # the last token (masked out) is far off
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = logprob_mismatch(rollout, policy, mask)
    diffs = [0.1, 0.0, 0.5, 0.0, 0.2]
    assert math.isclose(out["logprob_abs_diff_mean"], sum(diffs) / 5, rel_tol=1e-6)
    assert math.isclose(out["logprob_abs_diff_max"], 0.5, rel_tol=1e-6)
    # k3 of KL(rollout || policy) per token: exp(x) - x - 1 with x = policy - rollout
    d = [p - r for p, r in [(-1.1, -1.0), (-2.0, -2.0), (-2.5, -3.0), (-0.5, -0.5), (-0.3, -0.1)]]
    assert math.isclose(out["kl"], sum(math.exp(x) - x - 1 for x in d) / 5, rel_tol=1e-5)


def test_equal_logprobs_give_zero_and_empty_mask_is_finite():
    lp = -torch.rand(4, 6)
    assert logprob_mismatch(lp, lp.clone(), torch.ones(4, 6)) == {
        "logprob_abs_diff_mean": 0.0, "logprob_abs_diff_max": 0.0, "kl": 0.0}
    out = logprob_mismatch(lp, lp + 1.0, torch.zeros(4, 6))
    assert out == {"logprob_abs_diff_mean": 0.0, "logprob_abs_diff_max": 0.0, "kl": 0.0}


def test_kl_matches_the_exact_kl_in_expectation():
    """Tokens sampled from the rollout distribution: the mean k3 estimate approaches the exact
    KL(rollout || policy) (a biased estimator would not)."""
    g = torch.Generator().manual_seed(0)
    roll = torch.log_softmax(torch.randn(8, generator=g), -1)
    pol = torch.log_softmax(roll + 0.3 * torch.randn(8, generator=g), -1)
    tokens = torch.multinomial(roll.exp(), 200_000, replacement=True, generator=g)
    out = logprob_mismatch(roll[tokens][None], pol[tokens][None], torch.ones(1, len(tokens)))
    exact = float((roll.exp() * (roll - pol)).sum())
    assert abs(out["kl"] - exact) < 0.05 * exact
    assert out["logprob_abs_diff_max"] == float((pol - roll)[tokens.unique()].abs().max())


def test_routing_disagreement_compares_expert_sets_per_layer():
    # 3 tokens x 2 layers x top-2
    rollout = torch.tensor([[[0, 1], [2, 3]],
                            [[1, 2], [0, 3]],
                            [[3, 0], [1, 2]]])
    policy = torch.tensor([[[1, 0], [2, 3]],    # layer 0: the same set in another order
                           [[1, 3], [0, 3]],    # layer 0 differs
                           [[3, 0], [2, 0]]])   # layer 1 differs
    differ, counted = routing_disagreement(rollout, policy)
    assert differ.tolist() == [1.0, 1.0] and counted.tolist() == [3.0, 3.0]
    out = routing_disagreement_metrics(differ, counted)
    assert out == {"routing_disagreement/layer0": 1 / 3, "routing_disagreement/layer1": 1 / 3,
                   "routing_disagreement": 1 / 3, "routing_disagreement_max": 1 / 3}


def test_routing_disagreement_skips_unrecorded_and_masked_tokens():
    rollout = torch.tensor([[[[0, 1], [2, 3]], [[0, 1], [-1, -1]]]])  # [1, 2 tokens, 2 layers, 2]
    policy = torch.tensor([[[[0, 2], [-1, -1]], [[0, 2], [2, 3]]]])   # layer 1: one side unknown everywhere
    differ, counted = routing_disagreement(rollout, policy, mask=torch.tensor([[1, 0]]))
    assert differ.tolist() == [1.0, 0.0] and counted.tolist() == [1.0, 0.0]
    assert routing_disagreement_metrics(differ, counted) == {
        "routing_disagreement/layer0": 1.0, "routing_disagreement": 1.0, "routing_disagreement_max": 1.0}
    assert routing_disagreement_metrics(*routing_disagreement(rollout, rollout, torch.zeros(1, 2))) == {}


def test_routing_disagreement_refuses_shapes_that_differ():
    import pytest

    with pytest.raises(ValueError, match="layers, top-k"):
        routing_disagreement(torch.zeros(2, 3, 2), torch.zeros(2, 3, 1))
