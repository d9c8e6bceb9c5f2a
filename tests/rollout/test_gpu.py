"""GPU paths of the rollout: CUDA IPC (colocated) and NCCL (apart) weight sync, sleep/wake.

Skipped with the reason on machines without CUDA (see tests/conftest.py); NCCL needs two GPUs because
NCCL cannot put two ranks on one device.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

PROMPTS = ["hello world", [{"role": "user", "content": "What is 2+3?"}]]


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_model_factory):
    import ray

    from tests.helpers.ray_cluster import stop_shared_ray
    from workers.group import WorkerGroup
    from workers.roles.policy import PolicyWorker

    stop_shared_ray()  # this module's Ray sees the GPU
    path = tiny_model_factory("tiny-qwen2")
    ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    policy = None
    try:
        policy = WorkerGroup("policy", PolicyWorker, tp=1, name="gpu-sync-policy", num_cpus_per_worker=0.5,
                             num_gpus_per_worker=0.4, timeout_s=300, log_dir=tmp_path_factory.mktemp("logs"),
                             init_kwargs={"model_path": path, "micro_batch_size": 8, "optim": {"lr": 1e-2}})
        yield {"path": path, "policy": policy, "tmp": tmp_path_factory}
    finally:
        if policy is not None:
            policy.shutdown()
        ray.shutdown()


def _engine(env, **kw):
    from workers.rollout import EngineConfig, RolloutGroup

    cfg = EngineConfig(model_path=env["path"], kv_cache_gb=0.25, num_cpus=0.5, num_gpus=0.4, gpu_memory_utilization=0.2,
                       work_dir=str(env["tmp"].mktemp("rollout")), **kw)
    return RolloutGroup(cfg)


def _max_diff(policy, out) -> float:
    pol = policy.compute_logprobs(out.select(["input_ids", "attention_mask", "responses", "response_mask"]))
    return float(((pol["logprobs"] - out["rollout_logprobs"]) * out["response_mask"]).abs().max())


def test_cuda_ipc_sync_colocated_with_sleep_wake(env):
    from workers.rollout import SamplingConfig, SyncConfig

    rollout = _engine(env, enable_sleep_mode=True)
    try:
        cfg = SyncConfig(sync_bucket_mb=0.5, colocated=True)
        stats = rollout.sync_weights(env["policy"], cfg)
        assert stats["mismatch/canary_max_abs_diff"] <= 1e-3
        rollout.sleep()
        with pytest.raises(Exception, match="asleep"):
            rollout.generate(PROMPTS, SamplingConfig(max_tokens=4))
        rollout.wake_up(tags=["weights"])
        rollout.sync_weights(env["policy"], cfg, verify=False)
        rollout.wake_up(tags=["kv_cache"])
        out = rollout.generate(PROMPTS, SamplingConfig(n=2, max_tokens=12, seed=0))
        assert _max_diff(env["policy"], out) <= 1e-3
    finally:
        rollout.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="NCCL weight sync needs two GPUs (NCCL cannot place two ranks on one device)")
def test_nccl_sync_apart(env):
    from workers.rollout import SamplingConfig, SyncConfig

    rollout = _engine(env)
    try:
        stats = rollout.sync_weights(env["policy"], SyncConfig(sync_bucket_mb=0.5, sync_transport="nccl"))
        assert stats["mismatch/canary_max_abs_diff"] <= 1e-3
        out = rollout.generate(PROMPTS, SamplingConfig(n=2, max_tokens=12, seed=0))
        assert _max_diff(env["policy"], out) <= 1e-3
    finally:
        rollout.shutdown()
