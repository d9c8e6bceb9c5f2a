"""The one embedded Ray of a test process, shared by every in-process test that needs Ray.

It is started as `rlhf train` starts its own (`init_ray`: 127.0.0.1 only, a private temp dir, the reaper), with
4 CPUs, the first time a test asks for it, and stays up for the tests after: a Ray start costs 5-13 s on
2 cores. Tests are isolated by cleaning up what they started (their worker groups and engines) and by the
check `assert_cluster_free` makes when a module is done: every CPU back, else the leak is named and Ray is
restarted for the modules after. A test that must own its Ray (its own dashboard, or proof that a refusal
came before any Ray started) first calls `stop_shared_ray`; the next test that asks starts it again.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

NUM_CPUS = 4
_state: dict[str, Any] = {"own": None}


def shared_ray() -> None:
    """Start the shared Ray unless this process already has one (idempotent)."""
    import ray

    if ray.is_initialized():
        return
    from rlhf.config.schema import TrainerConfig
    from rlhf.driver.infra.ray_env import init_ray

    root = tempfile.mkdtemp(prefix="rlhf-test-ray-")
    # the workers' output stays in their log files: echoed here, a late line of one test's actor would land in
    # the output the next test reads
    _state["own"] = init_ray(TrainerConfig(output_dir=root, ray_num_cpus=NUM_CPUS), log_to_driver=False)


def stop_shared_ray() -> None:
    """Shut down this process's Ray (shared or not) and its reaper; a no-op when none runs."""
    import ray

    own, _state["own"] = _state["own"], None
    if own is not None:
        own.stop()
    elif ray.is_initialized():
        ray.shutdown()


def assert_cluster_free(what: str, timeout_s: float = 30.0) -> None:
    """Fail naming `what` when, `timeout_s` after it finished, some CPUs of the shared Ray are still held (an
    actor it started outlived it); Ray is then restarted, so the leak cannot starve the tests after it."""
    import ray

    if not ray.is_initialized():
        return
    total = ray.cluster_resources().get("CPU", 0.0)
    deadline = time.monotonic() + timeout_s
    while (free := ray.available_resources().get("CPU", 0.0)) < total and time.monotonic() < deadline:
        time.sleep(0.2)
    if free < total:
        stop_shared_ray()
        raise AssertionError(f"{what} left {total - free:g} of {total:g} CPUs of the shared Ray held (an actor it "
                             f"started is still alive); Ray was restarted for the tests after it")
