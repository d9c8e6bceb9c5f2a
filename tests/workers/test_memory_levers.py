"""The memory and overlap levers are exact: selective recompute with sequence parallelism at TP2, full
recompute at TP1 and the overlapped gradient reduce and parameter gather at DP2 (distributed optimizer) give
the plain TP1 group's log-probs, loss, gradient norm and update (real Ray, real megatron-core over gloo). The
deferred gather is finished before the weights are read: the second mini-batch's forward gathers the first
update bucket by bucket, and the weights fetched after the last step hold every rank's shard. Each rank logs
what is on."""

from __future__ import annotations

import pytest

from tests.helpers.batches import make_rl_batch
from tests.helpers.layouts import policy_groups
from workers.megatron.memory_levers import lever_overrides
from workers.roles import fetch_state_dict

OPTIM = {"lr": 1e-4, "clip_grad": 1.0, "weight_decay": 0.0}
LAYOUTS = {  # name: (tp, dp, the role's lever options)
    "plain": (1, 1, {}),
    "full": (1, 1, {"recompute": "full", "recompute_num_layers": 2}),
    "sp-selective": (2, 1, {"recompute": "selective", "sequence_parallel": True}),
    "dp2-overlap": (1, 2, {"optim": {**OPTIM, "overlap_grad_reduce": True, "overlap_param_gather": True,
                                     "use_distributed_optimizer": True}}),
}
LOG_LINES = {"plain": "memory levers: none", "full": "full recompute (uniform, 2 layer(s) a chunk)",
             "sp-selective": "selective recompute (core_attn), sequence parallel over tp=2",
             "dp2-overlap": "memory levers: gradient reduce overlapped with backward, parameter gather overlapped "
                            "with forward"}


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_factory):
    path = tiny_model_factory("tiny-qwen2")
    layouts = {name: {"tp": tp, "dp": dp, "levers": levers} for name, (tp, dp, levers) in LAYOUTS.items()}
    yield from policy_groups(path, tmp_path_factory, layouts, {"micro_batch_size": 4, "optim": OPTIM})


def test_each_rank_logs_its_levers(env):
    for name, g in env.items():
        for rank in range(g.world_size):
            assert LOG_LINES[name] in g.log_path(rank).read_text(), (name, rank)


def test_levers_give_the_same_logprobs_and_update(env):
    batch = make_rl_batch(n=8, seed=3)
    base = env["plain"].compute_logprobs(batch)["logprobs"]
    batch["old_logprobs"] = base
    loss_cfg = {"clip_low": 0.2, "clip_high": 0.28, "mini_batches": 2, "entropy_coef": 0.01}
    initial = fetch_state_dict(env["plain"].state_dict_for_rollout())
    metrics, weights = {}, {}
    for name, g in env.items():
        if name != "plain":
            assert (g.compute_logprobs(batch, micro_batch_size=3)["logprobs"] - base).abs().max() <= 1e-5, name
        metrics[name] = g.train_step(batch, loss_cfg, micro_batch_size=2)
        weights[name] = fetch_state_dict(g.state_dict_for_rollout())
    ref = weights["plain"]
    assert max((ref[k] - initial[k]).abs().max().item() for k in ref) > 5e-5  # the step moved the weights
    for name in ("full", "sp-selective", "dp2-overlap"):
        diff = max((weights[name][k] - ref[k]).abs().max().item() for k in ref)
        assert diff <= 1e-5, (name, diff)
        for key in ("loss", "grad_norm", "clipfrac"):
            assert metrics[name][key] == pytest.approx(metrics["plain"][key], rel=1e-5, abs=1e-6), (name, key)


def test_lever_fields():
    assert lever_overrides("none", 1, False, 1) == {}
    assert lever_overrides("selective", 1, True, 2) == {"recompute_granularity": "selective",
                                                       "recompute_modules": ["core_attn"], "sequence_parallel": True}
    assert lever_overrides("full", 3, False, 1)["recompute_num_layers"] == 3
    with pytest.raises(ValueError, match="sequence_parallel needs tensor parallelism"):
        lever_overrides("none", 1, True, 1)
    with pytest.raises(ValueError, match="recompute='partial'"):
        lever_overrides("partial", 1, False, 1)
