"""Start or join Ray: an embedded local instance bound to 127.0.0.1, or the cluster at RAY_ADDRESS/--address."""

from __future__ import annotations

import os

from rlhf.config.schema import TrainerConfig


def init_ray(trainer: TrainerConfig) -> bool:
    """Initialise Ray if needed; return True when this process started its own local instance."""
    import ray

    if ray.is_initialized():
        return False
    address = trainer.ray_address or os.environ.get("RAY_ADDRESS")
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}}
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=True)
        return False
    num_cpus = trainer.ray_num_cpus or max(4, os.cpu_count() or 1)
    ctx = ray.init(num_cpus=num_cpus, include_dashboard=trainer.dashboard, dashboard_host="127.0.0.1",
                   _node_ip_address="127.0.0.1", runtime_env=env, log_to_driver=True, configure_logging=False)
    if trainer.dashboard:
        print(f"Ray dashboard: http://{ctx.dashboard_url}", flush=True)
    return True
