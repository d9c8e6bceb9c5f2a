"""Critic, reward model and reference groups (real Ray, real megatron-core, CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.batches import make_rl_batch
from tests.helpers.layouts import ray_groups
from workers.batch import Batch, pad_sequences
from workers.group import WorkerGroup
from workers.roles import CriticWorker, PolicyWorker, ReferenceWorker, RewardModelWorker


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_factory):
    path = tiny_model_factory("tiny-qwen2")
    log_dir = tmp_path_factory.mktemp("logs")
    common = dict(num_cpus_per_worker=0.5, timeout_s=120, log_dir=log_dir)
    with ray_groups() as groups:
        groups["critic"] = WorkerGroup("critic", CriticWorker, tp=2, **common,
                                       init_kwargs={"model_path": path, "micro_batch_size": 4, "optim": {"lr": 1e-3}})
        groups["rm"] = WorkerGroup("reward_model", RewardModelWorker, **common,
                                   init_kwargs={"model_path": path, "micro_batch_size": 16, "optim": {"lr": 2e-3}})
        groups["ref"] = WorkerGroup("reference", ReferenceWorker, **common,
                                    init_kwargs={"model_path": path, "micro_batch_size": 4, "offload": True,
                                                 "pack_sequences": False})
        yield {"path": path, **groups}


def test_critic_values_shape_and_determinism(env):
    batch = make_rl_batch(n=6, seed=11)
    a = env["critic"].compute_values(batch)["values"]
    b = env["critic"].compute_values(batch, micro_batch_size=1)["values"]
    assert a.shape == batch["responses"].shape
    assert torch.all(a[batch["response_mask"] == 0] == 0) and torch.all(a[batch["response_mask"] == 1] != 0)
    assert (a - b).abs().max() <= 1e-5


def test_critic_train_step_fits_returns(env):
    batch = make_rl_batch(n=8, seed=12)
    batch["returns"] = torch.linspace(-1, 1, 8)[:, None].expand_as(batch["advantages"]) * batch["response_mask"]
    losses = []
    for _ in range(6):
        batch["values"] = env["critic"].compute_values(batch)["values"]
        m = env["critic"].train_step(batch, {"value_clip": 0.5, "mini_batches": 2})
        losses.append(m["vf_loss"])
        assert m["num_steps"] == 2 and m["skipped_steps"] == 0 and "vf_clipfrac" in m
    assert losses[-1] < 0.5 * losses[0]


def test_reward_model_scores_shape_determinism_and_padding_side(env):
    seqs = [torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 7, 5, 2)]
    right = Batch(dict(zip(("input_ids", "attention_mask"), pad_sequences(seqs))))
    left = Batch(dict(zip(("input_ids", "attention_mask"), pad_sequences(seqs, left=True))))
    s1 = env["rm"].compute_scores(right)["scores"]
    s2 = env["rm"].compute_scores(right, micro_batch_size=1)["scores"]
    s3 = env["rm"].compute_scores(left)["scores"]
    assert s1.shape == (4,)
    assert (s1 - s2).abs().max() <= 1e-5 and (s1 - s3).abs().max() <= 1e-4


def _pairs(n: int, seed: int) -> Batch:
    """Chosen responses use tokens [10, 60), rejected ones [60, 110), after a shared random prompt."""
    g = torch.Generator().manual_seed(seed)
    chosen, rejected = [], []
    for _ in range(n):
        prompt = torch.randint(110, 500, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        good = torch.randint(10, 60, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        bad = torch.randint(60, 110, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        chosen.append(torch.cat([prompt, good]))
        rejected.append(torch.cat([prompt, bad]))
    c_ids, c_mask = pad_sequences(chosen)
    r_ids, r_mask = pad_sequences(rejected)
    return Batch({"chosen_input_ids": c_ids, "chosen_attention_mask": c_mask,
                  "rejected_input_ids": r_ids, "rejected_attention_mask": r_mask})


def test_bradley_terry_training_learns_preferences(env):
    rm = env["rm"]
    train, held_out = _pairs(64, seed=1), _pairs(64, seed=2)

    def accuracy() -> float:
        out = rm.evaluate_pairs(held_out)
        return (out["chosen_scores"] > out["rejected_scores"]).float().mean().item()

    before = accuracy()
    for _ in range(4):
        for mini in train.split(4):
            m = rm.train_step(mini)
    assert m["skipped"] == 0 and 0 <= m["accuracy"] <= 1
    after = accuracy()
    assert after > 0.9, (before, after)


def test_reference_matches_policy_at_init(env):
    batch = make_rl_batch(n=5, seed=13)
    ref = env["ref"].compute_logprobs(batch)
    assert set(ref.keys()) == {"ref_logprobs"}
    policy = WorkerGroup("policy", PolicyWorker, num_cpus_per_worker=0.5, timeout_s=120,
                         log_dir=env["critic"].log_dir, init_kwargs={"model_path": env["path"]})
    try:
        pol = policy.compute_logprobs(batch)["logprobs"]
    finally:
        policy.shutdown()
    assert (ref["ref_logprobs"] - pol).abs().max() <= 1e-5  # unpacked reference vs packed policy


def test_update_configs_share_the_step_counts_and_reject_unknown_keys():
    from workers.config import build
    from workers.roles import PPOLossConfig, ValueLossConfig

    v = build(ValueLossConfig, {"ppo_epochs": 2, "mini_batches": 3, "value_clip": None})
    assert (v.ppo_epochs, v.mini_batches, v.value_clip, v.loss_agg_mode) == (2, 3, None, "token-mean")
    assert build(PPOLossConfig, None) == PPOLossConfig() and build(ValueLossConfig, v) is v
    with pytest.raises(ValueError, match=r"unknown ValueLossConfig keys \['clip_low'\]"):
        build(ValueLossConfig, {"clip_low": 0.2})
