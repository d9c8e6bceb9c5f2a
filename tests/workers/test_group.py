"""WorkerGroup mechanics with a toy (megatron-free) worker: dispatch modes, names in the Ray state API,
errors from a raising, a hanging and a killed rank, and resource requests the cluster cannot hold."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import pytest
import ray
import torch

from workers.batch import Batch
from workers.dispatch import ALL_TO_ALL, DP_COMPUTE, ONE_TO_ALL, register, split_by_minibatch
from workers.group import (
    ResourcePool,
    ResourceUnavailableError,
    Worker,
    WorkerDiedError,
    WorkerGroup,
    WorkerGroupError,
    WorkerTimeoutError,
)
from workers.group.wait import wait_all


class Toy(Worker):
    def setup(self) -> None:
        self.scale = self.init_kwargs.get("scale", 1)

    @register(ONE_TO_ALL)
    def all_reduce(self, x: float) -> float:
        t = torch.tensor([x + self.ctx.rank])
        torch.distributed.all_reduce(t)
        return t.item()

    @register(ONE_TO_ALL, collect="rank0")
    def rank0_value(self) -> int:
        return self.ctx.rank + 100

    @register(ONE_TO_ALL, collect="flatten")
    def my_items(self) -> list[int]:
        return [self.ctx.rank] * (self.ctx.rank % 2)

    @register(DP_COMPUTE)
    def double(self, batch: Batch) -> Batch:
        return Batch({"y": batch["x"] * 2 * self.scale, "dp": torch.full((len(batch),), self.dp_rank)},
                     {"who": [self.ctx.name] * len(batch)})

    @register(DP_COMPUTE, pad=False, split=split_by_minibatch())
    def rows(self, batch: Batch, cfg: dict) -> dict:
        return {"dp": self.dp_rank, "x": batch["x"].tolist()}

    @register(ONE_TO_ALL)
    def nice(self) -> int:
        return os.nice(0)

    @register(ALL_TO_ALL)
    def echo(self, v: str) -> tuple[int, str]:
        return self.ctx.rank, v

    @register(ONE_TO_ALL)
    def fail(self) -> None:
        raise ValueError(f"bad input on rank {self.ctx.rank}")

    @register(ONE_TO_ALL)
    def sleep_then_barrier(self, seconds: float) -> int:
        time.sleep(seconds)
        torch.distributed.barrier()
        return self.ctx.rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from tests.helpers.ray_cluster import stop_shared_ray

    stop_shared_ray()  # this module's Ray has a dashboard: its state API is under test
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    info = ray.init(num_cpus=4, include_dashboard=True, dashboard_port=_free_port(), logging_level="ERROR",
                    log_to_driver=False)
    # other Ray instances may run on this machine: address the state API of ours explicitly
    os.environ["TEST_DASHBOARD_URL"] = f"http://{info.dashboard_url}"
    yield tmp_path_factory.mktemp("logs")
    ray.shutdown()


@pytest.fixture(scope="module")
def group(cluster):
    g = WorkerGroup("toy", Toy, tp=2, dp=2, num_cpus_per_worker=0.5, timeout_s=60, log_dir=cluster,
                    init_kwargs={"scale": 3})
    yield g
    g.shutdown()


def test_dispatch_modes(group):
    assert group.all_reduce(1.0) == [10.0] * 4  # (1+0)+(1+1)+(1+2)+(1+3), a collective over the world
    assert group.rank0_value() == 100
    assert group.my_items() == [1, 3]
    assert group.nice() == [0, 0, 0, 0]  # Ray starts workers at nice 15; the ranks run at normal priority
    assert group.echo(["a", "b", "c", "d"]) == [(0, "a"), (1, "b"), (2, "c"), (3, "d")]
    out = group.double(Batch({"x": torch.arange(7)}))  # 7 rows over dp=2: padded to 8, pad removed
    assert out["y"].tolist() == [0, 6, 12, 18, 24, 30, 36]
    assert out["dp"].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert out["who"][0] == "toy/dp0-tp0-pp0" and out["who"][-1] == "toy/dp1-tp0-pp0"  # output ranks: tp 0
    fut = group.double.remote(Batch({"x": torch.arange(4)}))
    assert fut.get()["y"].tolist() == [0, 6, 12, 18] and fut.done()
    with pytest.raises(ValueError, match="all-to-all"):
        group.echo(["a"])


def test_minibatch_split_keeps_global_minibatches(group):
    # 2 mini-batches of 4 rows over dp=2: DP replica 0 holds rows 0,1 (mini 0) and 4,5 (mini 1).
    out = group.rows(Batch({"x": torch.arange(8)}), {"mini_batches": 2})
    assert out == {"dp": 0, "x": [0, 1, 4, 5]}
    with pytest.raises(ValueError, match="does not divide"):
        group.rows(Batch({"x": torch.arange(6)}), {"mini_batches": 2})


def test_actor_names_in_state_api(group):
    from ray.util.state import list_actors

    actors = list_actors(address=os.environ["TEST_DASHBOARD_URL"], filters=[("state", "=", "ALIVE")], limit=1000)
    names = {a.name for a in actors}
    assert {"toy/dp0-tp0-pp0", "toy/dp0-tp1-pp0", "toy/dp1-tp0-pp0", "toy/dp1-tp1-pp0"} <= names


def test_raising_method_names_rank_and_group_survives(group):
    with pytest.raises(WorkerGroupError, match=r"(?s)toy\.fail failed on role 'toy' rank \d.*ValueError: bad input"):
        group.fail()
    assert group.rank0_value() == 100  # every rank raised: nothing is stuck, the group stays usable


def test_dead_rank_while_others_wait_in_collective(cluster):
    g = WorkerGroup("doomed", Toy, tp=1, dp=3, num_cpus_per_worker=0.5, timeout_s=120, log_dir=cluster)
    try:
        fut = g.sleep_then_barrier.remote(3.0)
        time.sleep(1.0)
        os.kill(g.infos[1]["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError) as err:
            fut.get()
        assert time.monotonic() - t0 < 60  # noticed, not timed out (the group's timeout is 120 s)
        msg = str(err.value)
        assert "role 'doomed' rank 1 (doomed/dp1-tp0-pp0)" in msg and g.infos[1]["node_ip"] in msg
        assert "last log lines" in msg and "joined the world" in msg
        with pytest.raises(WorkerGroupError, match="unusable after an earlier failure"):
            g.rank0_value()
    finally:
        g.shutdown()


def test_timeout(cluster):
    g = WorkerGroup("slow", Toy, tp=1, dp=1, num_cpus_per_worker=0.5, timeout_s=60, log_dir=cluster)
    try:
        t0 = time.monotonic()
        with pytest.raises(WorkerTimeoutError, match="did not finish within 1s"):
            g.sleep_then_barrier.remote(30.0).get(timeout_s=1.0)
        assert time.monotonic() - t0 < 15  # the 1 s timeout, not the 30 s sleep
    finally:
        g.shutdown()


def test_shared_wait_reports_failures_by_index_and_stops_when_on_poll_raises(cluster):
    """The loop under every group's wait (worker ranks and rollout engines alike)."""

    @ray.remote(num_cpus=0)
    def task(seconds: float, fail: bool) -> float:
        time.sleep(seconds)
        if fail:
            raise ValueError("boom")
        return seconds

    seen: dict[str, list] = {}

    def on_failure(failures, pending):
        seen["failures"], seen["pending"] = [(i, type(e.cause).__name__) for i, e in failures], pending
        return WorkerGroupError("failed")

    def on_timeout(pending):
        return WorkerTimeoutError(f"stuck {pending}")

    assert wait_all([task.remote(0.1, False), task.remote(0.2, False)], 30, on_failure, on_timeout) == [0.1, 0.2]
    # on_ready sees each result as it arrives (the fast call while the slow one still runs) and its value is kept
    arrivals: list[tuple[int, float, int, float]] = []

    def on_ready(i, value, running):
        arrivals.append((i, value, running, time.monotonic()))
        return value * 10

    fast = task.remote(0.0, False)
    ray.get(fast, timeout=300)  # done before the wait starts, however slowly the machine starts workers
    slow = task.remote(3.0, False)
    assert wait_all([slow, fast], 60, on_failure, on_timeout, on_ready=on_ready) == [30.0, 0.0]
    assert [(i, running) for i, _, running, _ in arrivals] == [(1, 1), (0, 0)]
    assert arrivals[1][3] - arrivals[0][3] > 1.0  # the fast result was handled well before the slow one came
    with pytest.raises(WorkerGroupError, match="failed"):
        wait_all([task.remote(30, False), task.remote(0.1, True)], 60, on_failure, on_timeout)
    assert seen == {"failures": [(1, "ValueError")], "pending": [0]}
    done = task.remote(0.1, False)
    ray.get(done, timeout=300)  # finished before the wait starts, however slowly the machine starts workers
    with pytest.raises(WorkerTimeoutError, match=r"stuck \[0\]"):
        wait_all([task.remote(30, False), done], 2, on_failure, on_timeout)
    t0 = time.monotonic()

    def on_poll():
        if time.monotonic() - t0 > 1.0:
            raise RuntimeError("the other side failed")

    with pytest.raises(RuntimeError, match="other side"):
        wait_all([task.remote(30, False)], 60, on_failure, on_timeout, on_poll=on_poll)
    assert time.monotonic() - t0 < 15  # on_poll ended the wait, not the 30 s task


def test_impossible_resources_fail_fast(cluster):
    t0 = time.monotonic()
    with pytest.raises(ResourceUnavailableError, match=r"GPU.*cluster has only 0 GPU"):
        WorkerGroup("gpu-role", Toy, dp=2, num_gpus_per_worker=1.0, log_dir=cluster)
    with pytest.raises(ResourceUnavailableError, match=r"asked for 64 bundle\(s\).*cluster has only 4 CPU"):
        WorkerGroup("big-role", Toy, dp=64, num_cpus_per_worker=1.0, log_dir=cluster)
    # fits the cluster but not what is free right now (the module's group holds 2 CPUs): bounded wait
    with pytest.raises(ResourceUnavailableError, match="not ready after 3s"):
        WorkerGroup("busy-role", Toy, dp=3, num_cpus_per_worker=1.0, timeout_s=3, log_dir=cluster)
    assert time.monotonic() - t0 < 45  # no wait for the pool's 60 s start-up bound on the first two


def test_colocated_roles_share_a_pool(cluster):
    pool = ResourcePool("shared", num_bundles=1, cpus_per_bundle=0.5)
    try:
        a = WorkerGroup("role-a", Toy, num_cpus_per_worker=0.25, resource_pool=pool, log_dir=cluster)
        b = WorkerGroup("role-b", Toy, num_cpus_per_worker=0.25, resource_pool=pool, log_dir=cluster)
        assert a.infos[0]["node_id"] == b.infos[0]["node_id"]
        with pytest.raises(ResourceUnavailableError, match="already taken by colocated roles"):
            WorkerGroup("role-c", Toy, num_cpus_per_worker=0.25, resource_pool=pool, log_dir=cluster)
        a.shutdown()
        b.shutdown()
    finally:
        pool.shutdown()
