"""Prefix sharing (`pack_sequences="prefix"`): GRPO-style batches (n samples per prompt) give the same
logprobs, values and updates as plain packing, while computing each prompt once (real Ray, megatron-core)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.batches import grouped_batch
from tests.helpers.layouts import ray_groups
from workers.group import WorkerGroup
from workers.roles import CriticWorker, PolicyWorker, fetch_state_dict
from workers.roles.micro import prefix_shared_micros, response_micros, split_group

OPTIM = {"lr": 1e-4, "clip_grad": 1.0, "weight_decay": 0.0}


def test_each_prompt_is_computed_once():
    batch = grouped_batch(prompts=3, n=4)
    shared = prefix_shared_micros(batch, batch["input_ids"].shape[1] - batch["responses"].shape[1], 8,
                                  ["responses"], torch.device("cpu"))
    plain = response_micros(batch, 8, ["responses"], torch.device("cpu"), pack=True)
    assert len(shared) == 1 and shared[0].input_ids.shape[0] == 3  # one row per prompt
    response_tokens = int(batch["response_mask"].sum())
    assert int((shared[0].input_ids != 0).sum()) == response_tokens + (4 + 6 + 8)  # each prompt once
    assert sum(m.input_ids.numel() for m in shared) < sum(m.input_ids.numel() for m in plain)


def test_long_responses_split_the_group_by_the_cost_model():
    """Sharing a prompt puts its samples in one row whose attention grows with the row's square: short
    answers share one copy, long ones split into parts (each with its own copy) or are not shared at all."""
    assert split_group(list(range(8)), 17, [4] * 8) == [list(range(8))]  # the GRPO example: one row
    assert split_group(list(range(8)), 100, [100] * 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_group(list(range(8)), 20, [128] * 8) == [[i] for i in range(8)]
    cpu = torch.device("cpu")
    long = grouped_batch(prompts=2, n=8, prompt_len=20, resp_len=(120, 130))
    micros = response_micros(long, 4, ["responses"], cpu, pack="prefix")
    assert not any(m.explicit_positions for m in micros)  # nothing shared: plain packing, same rows
    plain = response_micros(long, 4, ["responses"], cpu, pack=True)
    assert [m.input_ids.shape for m in micros] == [m.input_ids.shape for m in plain]
    mid = grouped_batch(prompts=2, n=8, prompt_len=100, resp_len=(95, 106))
    shared = response_micros(mid, 8, ["responses"], cpu, pack="prefix")
    assert all(m.explicit_positions for m in shared)
    real = sum(int((m.input_ids != 0).sum()) for m in shared)
    assert real == int(mid["response_mask"].sum()) + 2 * (100 + 102)  # two copies of each prompt


@pytest.fixture(scope="module")
def groups(tiny_model_factory, tmp_path_factory):
    path = tiny_model_factory("tiny-qwen2")
    log_dir = tmp_path_factory.mktemp("logs")
    with ray_groups() as made:
        for name, cls, tp, pack in (("policy-pack", PolicyWorker, 1, True), ("policy-prefix", PolicyWorker, 1, "prefix"),
                                    ("policy-prefix-tp2", PolicyWorker, 2, "prefix"),
                                    ("critic-pack", CriticWorker, 1, True), ("critic-prefix", CriticWorker, 1, "prefix")):
            made[name] = WorkerGroup(name.split("-")[0], cls, tp=tp, name=name, num_cpus_per_worker=0.5, timeout_s=120,
                                     log_dir=log_dir, init_kwargs={"model_path": path, "micro_batch_size": 2,
                                                                   "optim": OPTIM, "pack_sequences": pack})
        yield made


@pytest.mark.parametrize("shape", ["short", "split"])  # split: long responses, each prompt in two parts
def test_same_logprobs_values_and_update(groups, shape):
    if shape == "short":
        batch = grouped_batch(prompts=3, n=4, seed=1)
    else:
        batch = grouped_batch(prompts=2, n=8, seed=1, prompt_len=100, resp_len=(95, 106))
    base = groups["policy-pack"].compute_logprobs(batch, with_entropy=True)
    for name in ("policy-prefix", "policy-prefix-tp2"):
        out = groups[name].compute_logprobs(batch, with_entropy=True)
        assert (out["logprobs"] - base["logprobs"]).abs().max() <= 1e-5, name
        assert (out["entropy"] - base["entropy"]).abs().max() <= 1e-5, name
    v_pack = groups["critic-pack"].compute_values(batch)["values"]
    v_prefix = groups["critic-prefix"].compute_values(batch)["values"]
    assert (v_pack - v_prefix).abs().max() <= 1e-5

    batch["old_logprobs"] = base["logprobs"]
    weights = {}
    for name in ("policy-pack", "policy-prefix", "policy-prefix-tp2"):
        groups[name].train_step(batch, {"clip_low": 0.2, "clip_high": 0.28})
        weights[name] = fetch_state_dict(groups[name].state_dict_for_rollout())
    ref = weights["policy-pack"]
    for name in ("policy-prefix", "policy-prefix-tp2"):
        diff = max((weights[name][k] - ref[k]).abs().max().item() for k in ref)
        assert diff <= 1e-5, (name, diff)
    after = groups["policy-prefix"].compute_logprobs(batch)["logprobs"]
    assert (after - base["logprobs"]).abs().max() > 1e-4  # the step did change the policy
