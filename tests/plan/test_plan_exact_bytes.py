"""The planner's parameter, gradient and optimizer-state bytes equal what the real engine allocates: a bf16
MegatronEngine (our optimizer settings: fp32 gradient buffer, fp32 master + Adam m, v) of the tiny presets
(tied dense, untied dense, MoE with a dense layer) at TP2 x DP2 with the distributed optimizer
and at PP2 without it."""

from __future__ import annotations

import pytest
from plan_rank_fns import engine_state_bytes

from rlhf.plan.layout import Layout
from rlhf.plan.memory import rank_params, state_bytes
from rlhf.plan.model import load_model
from workers.megatron.launch import run_distributed

PRESETS = ("tiny-qwen2", "tiny-llama", "tiny-qwen3-moe")


@pytest.fixture(scope="module")
def dirs(tiny_model_factory) -> list[str]:
    return [tiny_model_factory(p) for p in PRESETS]


@pytest.mark.parametrize("tp,pp,dp", [(2, 1, 2), (1, 2, 1)])
def test_state_bytes_exact(dirs, tp, pp, dp):
    dist_opt = dp > 1
    # The engine cannot build an MoE model with PP > 1 on CPU (its alltoall dispatcher needs a CUDA stream).
    presets = PRESETS if pp == 1 else PRESETS[:2]
    ranks = run_distributed(engine_state_bytes, tp * pp * dp, args=(dirs[: len(presets)], dist_opt), tp=tp, pp=pp,
                            timeout_s=900)
    lay = Layout(tp=tp, pp=pp, dp=dp, etp=tp, dist_opt=dist_opt)
    for i, preset in enumerate(presets):
        m = load_model(preset)
        measured = [r[i] for r in ranks]
        # bf16 weights, norms included (the engine casts megatron's fp32 torch-norm fallback on CPU)
        assert all(r["param_dtypes"] == ["torch.bfloat16"] for r in measured)
        for r in measured:
            est = state_bytes(rank_params(m, lay, r["pp_rank"]), lay, 2, trainable=True)
            assert r["params"] == est["params"], (preset, r, est)
            assert r["grads"] == est["grads"], (preset, r, est)
            if not dist_opt:
                assert r["optimizer"] == est["optimizer"], (preset, r, est)
        if dist_opt:
            # Each DP rank owns a contiguous shard of the (padded) buffer, so shards may differ by the padding;
            # summed over the DP x TP ranks they are exactly the planner's per-rank bytes x DP x TP.
            est = state_bytes(rank_params(m, lay, 0), lay, 2, trainable=True)["optimizer"]
            assert sum(r["optimizer"] for r in measured) == pytest.approx(est * dp * tp, abs=0.5), (preset, measured)
            assert max(r["optimizer"] for r in measured) <= est * 1.01
