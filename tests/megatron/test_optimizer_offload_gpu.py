"""Optimizer CPU offload (megatron-core's HybridDeviceOptimizer: Adam's state and fp32 master weights on the
host) gives the same update as the all-GPU optimizer. GPU only: the hybrid optimizer copies over CUDA streams,
and on a CPU run the state is in host memory already (the config refuses it there)."""

from __future__ import annotations

import importlib.util

import pytest
from lora_fns import train_full

from workers.megatron.launch import DistributedError, run_distributed

pytestmark = pytest.mark.gpu


def test_cpu_offload_gives_the_gpu_optimizers_update(tiny_model_factory):
    path = tiny_model_factory("tiny-qwen2")
    dist = {"use_distributed_optimizer": True}
    plain = run_distributed(train_full, 1, args=(path, dist), timeout_s=600)[0]
    assert plain["losses"][-1] < plain["losses"][0]
    if importlib.util.find_spec("transformer_engine") is None:  # megatron-core's hybrid optimizer is built on TE
        with pytest.raises(DistributedError, match="optim.cpu_offload needs transformer-engine"):
            run_distributed(train_full, 1, args=(path, {**dist, "cpu_offload": True}), timeout_s=600)
        pytest.skip("transformer-engine missing: its refusal checked; comparing the updates needs it")
    offload = run_distributed(train_full, 1, args=(path, {**dist, "cpu_offload": True}), timeout_s=600)[0]
    assert offload["losses"] == pytest.approx(plain["losses"], rel=1e-4)
    for name, w in plain["weights"].items():  # CPU and CUDA Adam kernels: float noise, not a different update
        assert (offload["weights"][name] - w).abs().max() <= 1e-4 * max(1.0, w.abs().max().item()), name
