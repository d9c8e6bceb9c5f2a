"""megatron-core trains on CPU over gloo (one process, and TP=2 in two processes) through the CPU shim."""

from __future__ import annotations

import pytest
from mcore_train_fns import (
    bf16_checkpoint_round_trip,
    compat_then_train,
    never_stepped_checkpoint_round_trip,
    train_tiny_gpt,
)

from workers.megatron.cpu_compat import MCORE_VERSION, check_mcore_version
from workers.megatron.launch import run_distributed


def test_cpu_compat_refuses_another_megatron_core():
    check_mcore_version()  # the installed one is the one the patches were written for
    with pytest.raises(RuntimeError, match=rf"megatron-core {MCORE_VERSION} internals, but megatron-core 0.17.0 is"):
        check_mcore_version("0.17.0")


def test_cpu_compat_and_training_tp1_tp2():
    out, tp1 = run_distributed(compat_then_train, 1)[0]
    # The compatibility layer, in a fresh process (patched process-wide once, device mode per block).
    assert out["applied"] is True and out["modes_main"] == 1
    assert out["device"] == "cpu" and out["to_cuda"] == "cpu" and out["pinned"] == "cpu"
    assert out["cuda_noop"] is True
    assert out["type"] == "torch.cuda.FloatTensor"
    assert out["current_device"] == "cpu"
    assert out["thread_device"] == "cpu" and out["thread_modes"] == 1
    assert out["thread_modes_before"] == out["thread_modes_after"] == 0
    assert out["fork_advances"] and out["fork_restores"]
    # A 2-layer local-spec GPT trains with a falling loss in one process ...
    assert tp1[-1] < tp1[0] - 1.0, tp1
    assert all(b < a for a, b in zip(tp1, tp1[1:])), tp1
    # ... and with TP=2 over gloo, reproducing the single-process run (same CPU-initialised weights).
    tp2 = run_distributed(train_tiny_gpt, 2, tp=2)
    assert tp2[0] == tp2[1]  # both TP ranks see the same (all-reduced) loss
    assert max(abs(a - b) for a, b in zip(tp1, tp2[0])) < 1e-4, (tp1, tp2[0])


def test_bf16_engine_checkpoint_round_trip(tiny_model_factory, tmp_path):
    """A bf16 engine's checkpoint (weights and fp32 master copies) loads back exactly. On CPU megatron's torch
    norm fallback builds fp32 norm weights, which its 16-bit optimizer's checkpoint mapped onto the wrong
    weights (a shape assertion at save); the engine gives every weight the model's dtype."""
    out = run_distributed(bf16_checkpoint_round_trip, 1, args=(tiny_model_factory("tiny-qwen3"), str(tmp_path / "ck")))[0]
    assert out["dtypes"] == ["torch.bfloat16"]
    assert out["weight_diff"] == 0 and out["master_diff"] == 0, out
    # the synchronous save passed its results through an in-process queue: no spawned Manager process
    # (cpu_compat._in_process_save_results; it cost a fresh interpreter, seconds, at each rank's first save)
    assert out["results_queue"] == "queue.Queue" and out["children"] == [], out


def test_checkpoint_before_the_first_optimizer_step_resumes(tiny_model_factory, tmp_path):
    """A checkpoint saved before any optimizer step (an fp16 run whose first steps all overflowed) had no Adam
    state, so its resume failed in dist_checkpointing ("optimizer.state.exp_avg... not in state dict"); it
    now loads, and the first step after it matches the uninterrupted engine's."""
    out = run_distributed(never_stepped_checkpoint_round_trip, 1,
                          args=(tiny_model_factory("tiny-qwen3"), str(tmp_path / "ck")))[0]
    assert out["steps"] == 0 and out["moved"] > 1e-3, out
    assert out["weight_diff"] == 0, out
