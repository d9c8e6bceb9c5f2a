"""Context parallelism is exact: a CP2 policy group (each sequence split over 2 ranks in the load-balanced
order, keys and values all-gathered for attention, the logits gathered for the loss) gives the plain CP1
group's log-probs, loss, gradient norm and update (real Ray, real megatron-core over gloo), and only its
CP rank 0 returns results."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.batches import make_rl_batch
from tests.helpers.layouts import policy_groups
from workers.megatron.context_parallel import local_columns, sequence_order
from workers.roles import fetch_state_dict

OPTIM = {"lr": 1e-4, "clip_grad": 1.0, "weight_decay": 0.0}


def test_columns_are_load_balanced_and_reassemble():
    assert local_columns(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_columns(8, 2, 1).tolist() == [2, 3, 4, 5]
    row = torch.arange(12) * 10
    gathered = torch.cat([row[local_columns(12, 3, r)] for r in range(3)])
    assert torch.equal(gathered[sequence_order(12, 3)], row)
    with pytest.raises(ValueError, match="multiple of 2 x cp = 4"):
        local_columns(6, 2, 0)


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_factory):
    path = tiny_model_factory("tiny-qwen2")
    yield from policy_groups(path, tmp_path_factory, {"plain": {"cp": 1}, "cp2": {"cp": 2}},
                             {"micro_batch_size": 4, "optim": OPTIM})


def test_cp2_gives_the_same_logprobs_and_update(env):
    cp2 = env["cp2"]
    assert cp2.world_size == 2 and cp2.names == ["policy-cp2/dp0-cp0-tp0-pp0", "policy-cp2/dp0-cp1-tp0-pp0"]
    for rank in range(2):
        assert "memory levers: context parallel over cp=2" in cp2.log_path(rank).read_text()
    assert "memory levers: none" in env["plain"].log_path(0).read_text()
    batch = make_rl_batch(n=8, seed=3)
    base = env["plain"].compute_logprobs(batch)["logprobs"]
    got = cp2.compute_logprobs(batch, micro_batch_size=3)["logprobs"]
    assert got.shape == base.shape and (got - base).abs().max() <= 1e-5
    batch["old_logprobs"] = base
    loss_cfg = {"clip_low": 0.2, "clip_high": 0.28, "mini_batches": 2, "entropy_coef": 0.01}
    initial = fetch_state_dict(env["plain"].state_dict_for_rollout())
    metrics = {n: g.train_step(batch, loss_cfg, micro_batch_size=2) for n, g in env.items()}
    weights = {n: fetch_state_dict(g.state_dict_for_rollout()) for n, g in env.items()}
    ref = weights["plain"]
    assert max((ref[k] - initial[k]).abs().max().item() for k in ref) > 5e-5  # the step moved the weights
    diff = max((weights["cp2"][k] - ref[k]).abs().max().item() for k in ref)
    assert diff <= 1e-5, diff
    for key in ("loss", "grad_norm", "clipfrac"):
        assert metrics["cp2"][key] == pytest.approx(metrics["plain"][key], rel=1e-5, abs=1e-6), key
