"""Start-up time of a worker group and of a rollout engine, against a Ray actor that only imports torch.

Every run, and every end-to-end test, starts its roles before its first step; on 2 cores a role's start is
mostly imports (torch, megatron-core, transformers, vLLM). The peer is the smallest actor a role could be: one
that imports torch and answers. Each is started and shut down `--rounds` times on one embedded Ray (the median
is reported); nothing else runs meanwhile.

    python bench/worker_start.py [--rounds 3]

Prints `RATIO policy_start_vs_torch_actor` and `RATIO engine_start_vs_torch_actor`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import ray

from rlhf.config.schema import TrainerConfig
from rlhf.driver.infra.ray_env import init_ray
from rlhf.tiny_models import create_tiny_model
from workers.group import WorkerGroup
from workers.roles.policy import PolicyWorker
from workers.rollout import EngineConfig, RolloutGroup


@ray.remote(num_cpus=0.5)
class TorchActor:
    """The peer: an actor that imports torch."""

    def ready(self) -> str:
        import torch

        return torch.__version__


def _torch_actor(_: str, __: Path) -> None:
    actor = TorchActor.remote()
    ray.get(actor.ready.remote(), timeout=300)
    ray.kill(actor)


def _policy(model: str, logs: Path) -> None:
    group = WorkerGroup("policy", PolicyWorker, tp=1, pp=1, name="bench-policy", num_cpus_per_worker=0.5,
                        timeout_s=300, log_dir=logs, init_kwargs={"model_path": model, "micro_batch_size": 8})
    group.shutdown()


def _engine(model: str, logs: Path) -> None:
    engine = RolloutGroup(EngineConfig(model_path=model, kv_cache_gb=0.05, max_num_seqs=32, num_cpus=0,
                                       work_dir=str(logs)))
    engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rlhf-bench-start-"))
    model = str(create_tiny_model("tiny-qwen2", root / "model"))
    own = init_ray(TrainerConfig(output_dir=str(root / "run"), ray_num_cpus=4), log_to_driver=False)
    times: dict[str, list[float]] = {"torch_actor": [], "policy": [], "engine": []}
    try:
        for r in range(args.rounds):
            for name, start in (("torch_actor", _torch_actor), ("policy", _policy), ("engine", _engine)):
                t0 = time.perf_counter()
                start(model, root / f"{name}-{r}")
                times[name].append(time.perf_counter() - t0)
    finally:
        if own is not None:
            own.stop()
    load = os.getloadavg()[0]
    print(f"| start-up (median of {args.rounds}, load {load:.1f}) | seconds | rounds |")
    print("|---|---|---|")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.2f} | {', '.join(f'{v:.2f}' for v in values)} |")
    peer = statistics.median(times["torch_actor"])
    print(f"RATIO policy_start_vs_torch_actor {statistics.median(times['policy']) / peer:.3f}")
    print(f"RATIO engine_start_vs_torch_actor {statistics.median(times['engine']) / peer:.3f}")


if __name__ == "__main__":
    main()
