"""DeepSeek-V3 training with expert parallelism on tiny-deepseek-v3 (real Ray, real megatron-core over gloo,
the allgather dispatcher; MLA, sigmoid router with group top-k and the expert bias): one train step at EP=2
equals EP=1 with the router losses on, a checkpoint saved at EP=2 resumes at EP=1, and the router metrics
come back with each step (tests/workers/test_moe_training.py does the same and more for Qwen2-MoE). The
expert biases (aux-loss-free balancing) are updated by each training pass, equal at both EPs (EP filler
micro-batches do not count), and saved and resumed with the checkpoint.

Both groups are DP=2 (EP=2 takes its ranks from the data-parallel ones), so each rank routes the same
tokens in both layouts and the per-micro-batch load-balancing loss is the same. One Ray session and the
two groups serve the module; the tests run in file order.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.batches import lm_batch
from tests.helpers.layouts import (
    assert_same_lm_step,
    assert_uneven_micro_batches_match,
    max_diff,
    ray_groups,
    weights,
)
from workers.group import WorkerGroup
from workers.roles import PolicyWorker

MOE = {"aux_loss_coeff": 0.01, "z_loss_coeff": 0.001, "expert_bias_update_rate": 1e-3}
BIAS = "mlp.gate.e_score_correction_bias"  # DeepSeek-V3's expert bias (HF name)
OPTIM = {"lr": 1e-3, "clip_grad": 1.0}
METRICS = ("moe/aux_loss", "moe/z_loss", "moe/load_imbalance", "moe/load_imbalance_max")


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_factory):
    path = tiny_model_factory("tiny-deepseek-v3")
    log_dir = tmp_path_factory.mktemp("logs")
    with ray_groups() as groups:
        for ep in (1, 2):
            groups[ep] = WorkerGroup(
                "policy", PolicyWorker, tp=1, pp=1, dp=2, name=f"policy-ep{ep}", num_cpus_per_worker=0.5,
                timeout_s=180, log_dir=log_dir,
                init_kwargs={"model_path": path, "micro_batch_size": 2, "optim": OPTIM, "ep": ep, "moe": MOE},
            )
        yield groups


def biases(w: dict) -> dict:
    return {k: v for k, v in w.items() if k.endswith(BIAS)}


def test_train_step_at_ep2_equals_ep1(env):
    initial = weights(env[1])
    batch = lm_batch(1)
    out = {ep: g.train_lm_step(batch) for ep, g in env.items()}
    after = {ep: weights(g) for ep, g in env.items()}
    assert any("experts.3." in k for k in after[2])  # every expert comes back from the EP=2 group
    assert max_diff(after[1], initial) > 1e-4  # the step moved the weights
    diff = max_diff(after[2], after[1])  # every HF tensor, DeepSeek's expert biases included
    print(f"EP2 vs EP1 after one step: max |param diff| = {diff:.2e}; metrics {out[2]}")
    assert diff <= 1e-5
    assert biases(initial)
    for k, b in biases(after[1]).items():
        step = (b - initial[k]).abs()  # aux-loss-free balancing: each bias moved by the update rate
        assert torch.allclose(step[step > 0], torch.tensor(MOE["expert_bias_update_rate"]), atol=1e-7), (k, step)
        assert (step > 0).sum() >= 2, (k, step)  # at least one expert up and one down
    for key in ("loss", "grad_norm", *METRICS):
        assert out[2][key] == pytest.approx(out[1][key], rel=1e-5, abs=1e-7), key
    m = out[2]
    assert all(math.isfinite(m[k]) for k in METRICS)
    assert m["moe/aux_loss"] > 0 and m["moe/z_loss"] > 0
    assert 1.0 <= m["moe/load_imbalance"] <= m["moe/load_imbalance_max"] <= 4 / 2  # at most experts / top-k


def test_checkpoint_saved_at_ep2_resumes_at_ep1(env, tmp_path):
    ckpt = str(tmp_path / "ep2")
    env[2].save_checkpoint(ckpt)
    env[1].train_lm_step(lm_batch(2))  # EP=1 moves away from the saved state
    saved = biases(weights(env[2]))
    assert saved and max_diff(biases(weights(env[1])), saved) > 0  # EP=1's biases moved on too
    meta = env[1].load_checkpoint(ckpt)
    assert meta["layout"]["ep"] == 2
    assert max_diff(biases(weights(env[1])), saved) == 0  # the biases came back with the checkpoint
    assert_same_lm_step(env[2], env[1], lm_batch(3))


def test_uneven_micro_batch_counts_at_ep2_equal_ep1(env):
    """Packed RL batches give the DP ranks different numbers of micro-batches; at EP=2 the rank with fewer
    runs fillers to keep the EP group's token dispatch in step. Log-probs and a PPO update still equal EP=1's
    (MLA takes explicit positions, so prefix sharing is on)."""
    assert_uneven_micro_batches_match(env[1], env[2])
