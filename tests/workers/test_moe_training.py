"""MoE training with expert parallelism on tiny-qwen2-moe (real Ray, real megatron-core over gloo, the
allgather dispatcher): one train step at EP=2 and at TP=2 x EP=2 equals EP=1 with the router losses on, a
checkpoint saved at EP=2 resumes at EP=1, the router metrics come back with each step, and routing replay
(R3) makes the forward use exactly the given experts while the routers still get gradients.

Every group is DP=2 (EP=2 takes its ranks from the data-parallel ones), so each rank routes the same
tokens in every layout and the per-micro-batch load-balancing loss is the same. One Ray session and the
three groups serve the whole module (the TP2 x EP2 one, with routing replay on, at 0.5 CPU per rank like
the others); the tests run in file order.
"""

from __future__ import annotations

import math

import pytest
import torch

from algorithms.mismatch import routing_disagreement, routing_disagreement_metrics
from tests.helpers.batches import grouped_batch, lm_batch, make_rl_batch, micro_counts
from tests.helpers.layouts import (
    assert_same_lm_step,
    assert_uneven_micro_batches_match,
    max_diff,
    ray_groups,
    weights,
)
from workers.group import WorkerGroup
from workers.roles import PolicyWorker
from workers.roles.routes import POLICY_ROUTES_KEY, ROUTES_KEY

MOE = {"aux_loss_coeff": 0.01, "z_loss_coeff": 0.001}
# Adam's eps at 1e-6: its first step moves every weight by ~lr x sign(grad), which turns the rounding of
# near-zero gradients (TP2 sums them in another order) into lr-sized weight differences at eps=1e-8
OPTIM = {"lr": 1e-3, "clip_grad": 1.0, "eps": 1e-6}
METRICS = ("moe/aux_loss", "moe/z_loss", "moe/load_imbalance", "moe/load_imbalance_max")
TP2_EP2 = 22  # the key of the TP=2 x EP=2 group (routing replay on)


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_factory):
    path = tiny_model_factory("tiny-qwen2-moe")
    log_dir = tmp_path_factory.mktemp("logs")
    with ray_groups() as groups:
        for ep, tp in ((1, 1), (2, 1), (TP2_EP2, 2)):
            moe = {**MOE, "routing_replay": True} if ep == TP2_EP2 else MOE
            groups[ep] = WorkerGroup(
                "policy", PolicyWorker, tp=tp, pp=1, dp=2, name=f"policy-ep{ep}", num_cpus_per_worker=0.5,
                timeout_s=180, log_dir=log_dir,
                init_kwargs={"model_path": path, "micro_batch_size": 2, "optim": OPTIM, "ep": min(int(ep), 2),
                             "moe": moe},
            )
        yield groups


def test_train_step_at_ep2_and_tp2_ep2_equals_ep1(env):
    initial = weights(env[1])
    batch = lm_batch(1)
    out = {ep: g.train_lm_step(batch) for ep, g in env.items()}
    after = {ep: weights(g) for ep, g in env.items()}
    assert any("experts.3." in k for k in after[2])  # every expert comes back from the EP=2 group
    assert max_diff(after[1], initial) > 1e-4  # the step moved the weights
    for ep in (2, TP2_EP2):
        diff = max_diff(after[ep], after[1])
        print(f"{'EP2' if ep == 2 else 'TP2xEP2'} vs EP1 after one step: max |param diff| = {diff:.2e}; "
              f"metrics {out[ep]}")
        assert diff <= 1e-5
        for key in ("loss", "grad_norm", *METRICS):
            # under sequence parallelism (MoE at TP > 1) the z-loss metric is the mean of the TP slices' means
            rel = 1e-2 if ep == TP2_EP2 and key == "moe/z_loss" else 1e-5
            assert out[ep][key] == pytest.approx(out[1][key], rel=rel, abs=1e-7), (ep, key)
    m = out[2]
    assert all(math.isfinite(m[k]) for k in METRICS)
    assert m["moe/aux_loss"] > 0 and m["moe/z_loss"] > 0
    assert 1.0 <= m["moe/load_imbalance"] <= m["moe/load_imbalance_max"] <= 4 / 2  # at most experts / top-k
    per_layer = [m[f"moe/load_imbalance/layer{i}"] for i in (0, 1)]  # tiny-qwen2-moe: both layers MoE
    assert max(per_layer) == m["moe/load_imbalance_max"] and sum(per_layer) / 2 == pytest.approx(m["moe/load_imbalance"])


LOSS = {"clip_low": 0.2, "clip_high": 0.28}


def unrouted(batch):
    """`batch` with an empty routing: every token routes freely (the policy's own choice)."""
    b, t = batch["input_ids"].shape
    batch[ROUTES_KEY] = torch.full((b, t, 2, 2), -1, dtype=torch.int16)  # tiny-qwen2-moe: 2 layers, top-2
    return batch


def other_experts(routes: torch.Tensor, layer: int) -> torch.Tensor:
    """`routes` with `layer`'s top-2 of 4 experts replaced by the two experts it did not choose."""
    out = routes.clone()
    known = routes[..., layer, 0] >= 0
    idx = torch.where(known[..., None], routes[..., layer, :], torch.tensor([0, 1], dtype=routes.dtype)).long()
    chosen = torch.zeros(*routes.shape[:2], 4, dtype=torch.bool).scatter_(-1, idx, True)
    rest = (~chosen).nonzero()[:, -1].view(*routes.shape[:2], 2)
    out[..., layer, :] = torch.where(known[..., None], rest.to(routes.dtype), routes[..., layer, :])
    return out


@pytest.mark.parametrize("shape", ["prompt-shared", "uneven"])
def test_routing_replay_uses_exactly_the_recorded_experts(env, shape):
    """Prompt-shared packed rows (EP padding), and packed rows whose micro-batch counts differ between the DP
    ranks (EP fillers): replaying the policy's own routing changes nothing (the routes land on their tokens),
    replaying other experts in layer 0 makes every token of that layer use them (and changes the log-probs),
    and without replay the routing disagreement with those routes is all of layer 0 and none of layer 1."""
    batch = unrouted(grouped_batch(prompts=3, n=3, seed=5) if shape == "prompt-shared" else make_rl_batch(n=5, seed=4))
    assert micro_counts(batch) == ([2, 2] if shape == "prompt-shared" else [3, 2])
    free = env[1].compute_logprobs(batch, micro_batch_size=1)
    natural = free[POLICY_ROUTES_KEY]
    real = batch["attention_mask"].bool()
    assert bool((natural[real] >= 0).all()) and bool((natural[~real] < 0).all())
    batch[ROUTES_KEY] = natural
    same = env[TP2_EP2].compute_logprobs(batch, micro_batch_size=1)
    assert (same["logprobs"] - free["logprobs"]).abs().max() <= 1e-5
    differ, counted = routing_disagreement(natural, same[POLICY_ROUTES_KEY], batch["attention_mask"])
    assert differ.tolist() == [0.0, 0.0] and counted.tolist() == [float(real.sum())] * 2

    batch[ROUTES_KEY] = forced = other_experts(natural, layer=0)
    replayed = env[TP2_EP2].compute_logprobs(batch, micro_batch_size=1)
    used = replayed[POLICY_ROUTES_KEY]
    assert torch.equal(used[real].sort(-1).values, forced[real].sort(-1).values)  # the layer's selection
    assert (replayed["logprobs"] - free["logprobs"]).abs().max() > 1e-3
    no_replay = env[1].compute_logprobs(batch, micro_batch_size=1)
    metrics = routing_disagreement_metrics(*routing_disagreement(forced, no_replay[POLICY_ROUTES_KEY],
                                                                 batch["attention_mask"]))
    assert metrics["routing_disagreement/layer0"] == 1.0 and metrics["routing_disagreement/layer1"] == 0.0


def test_routing_replay_update_still_trains_the_routers(env, tmp_path):
    """A PPO update with replayed routes: the routers move by more than their own losses move them (the
    same update with zero advantages), so the policy gradient reaches the router logits through the
    replayed experts' scores."""
    batch = unrouted(grouped_batch(prompts=2, n=4, seed=6))
    batch[ROUTES_KEY] = other_experts(env[1].compute_logprobs(batch)[POLICY_ROUTES_KEY], layer=0)
    g = env[TP2_EP2]
    batch["old_logprobs"] = g.compute_logprobs(batch)["logprobs"]
    ckpt = str(tmp_path / "before")
    g.save_checkpoint(ckpt)
    g.train_step(batch, LOSS)
    with_pg = weights(g)
    g.load_checkpoint(ckpt)
    batch["advantages"] = torch.zeros_like(batch["advantages"])
    g.train_step(batch, LOSS)
    without = weights(g)
    for layer in (0, 1):
        name = f"model.layers.{layer}.mlp.gate.weight"
        assert (with_pg[name] - without[name]).abs().max() > 1e-6, name


def test_checkpoint_saved_at_ep2_resumes_at_ep1(env, tmp_path):
    ckpt = str(tmp_path / "ep2")
    env[2].save_checkpoint(ckpt)
    env[1].train_lm_step(lm_batch(2))  # EP=1 moves away from the saved state
    meta = env[1].load_checkpoint(ckpt)
    assert meta["layout"]["ep"] == 2
    assert_same_lm_step(env[2], env[1], lm_batch(3))


def test_uneven_micro_batch_counts_at_ep2_equal_ep1(env):
    """Packed RL batches give the DP ranks different numbers of micro-batches; at EP=2 the rank with fewer
    runs fillers to keep the EP group's token dispatch in step. Log-probs and a PPO update still equal EP=1's."""
    assert_uneven_micro_batches_match(env[1], env[2])
