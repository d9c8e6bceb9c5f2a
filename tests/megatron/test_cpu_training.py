"""Issue 2: megatron-core trains on CPU over gloo (one process, and TP=2 in two processes)."""

from __future__ import annotations

from mcore_train_fns import check_cpu_compat, train_tiny_gpt

from workers.megatron.testing import run_distributed


def test_cpu_compat_layer():
    out = run_distributed(check_cpu_compat, 1)[0]
    assert out["modes_main"] == 1
    assert out["device"] == "cpu" and out["to_cuda"] == "cpu" and out["pinned"] == "cpu"
    assert out["cuda_noop"] is True
    assert out["type"] == "torch.cuda.FloatTensor"
    assert out["current_device"] == "cpu"
    assert out["mask"] == [[[[False, True, True], [False, False, True], [False, False, False]]]]
    assert out["thread_device"] == "cpu" and out["thread_modes"] == 1
    assert out["fork_advances"] and out["fork_restores"]


def test_train_falling_loss_tp1_and_tp2():
    tp1 = run_distributed(train_tiny_gpt, 1)[0]
    assert tp1[-1] < tp1[0] - 1.0, tp1
    assert all(b < a for a, b in zip(tp1, tp1[1:])), tp1
    tp2 = run_distributed(train_tiny_gpt, 2, tp=2)
    assert tp2[0] == tp2[1]  # both TP ranks see the same (all-reduced) loss
    # Same CPU-initialised weights: TP=2 reproduces the single-process run.
    assert max(abs(a - b) for a, b in zip(tp1, tp2[0])) < 1e-4, (tp1, tp2[0])
