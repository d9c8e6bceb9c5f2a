"""Worker groups, weight sync and node loss on a Ray cluster of four nodes simulated on this machine (tests/
helpers/local_cluster.py): a head (127.0.0.10, 1 CPU), nodes a and b (127.0.0.2 / .3, 2 CPUs each) and node c
(127.0.0.4, no CPUs) that sees the folder `unshared/` through a private tmpfs, as a node without the shared
storage would. Real raylets, real megatron-core, vLLM and gloo; one cluster for the module, the tests in
file order (the last one kills node b).

Where ranks land follows from the CPUs: a bundle of 1.5 CPUs fits only on a or b, so a policy with 1.5 CPUs
a rank and strict_spread has a rank on each, and an engine of 1 CPU then fits only on the head.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import ray
import torch

from rlhf.driver.infra.shared_dir import check_shared_run_dir
from rlhf.errors import UserError
from tests.helpers.batches import make_rl_batch
from tests.helpers.local_cluster import LocalCluster, NodeSpec
from tests.helpers.ray_cluster import stop_shared_ray
from workers.group import NodeLostError, ResourceUnavailableError, WorkerGroup
from workers.roles import PolicyWorker, fetch_state_dict
from workers.rollout import EngineConfig, RolloutGroup, SyncConfig

ROOT_ONLY = os.geteuid() != 0  # node c's private tmpfs needs `unshare -m`
OPTIM = {"lr": 1e-4, "clip_grad": 1.0, "weight_decay": 0.0}
LOSS = {"clip_low": 0.2, "clip_high": 0.28, "mini_batches": 2, "entropy_coef": 0.01}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_factory):
    path = tiny_model_factory("tiny-qwen2")
    root = Path(f"/tmp/rlhf-mn-{os.getpid()}")  # short: Ray's socket paths have a length limit
    shared = tmp_path_factory.mktemp("storage")
    (shared / "unshared").mkdir()
    nodes = [NodeSpec("head", "127.0.0.10", 1), NodeSpec("a", "127.0.0.2", 2), NodeSpec("b", "127.0.0.3", 2)]
    if not ROOT_ONLY:
        nodes.append(NodeSpec("c", "127.0.0.4", 0, private_dirs=[str(shared / "unshared")]))
    stop_shared_ray()  # this process joins the simulated cluster instead
    with LocalCluster(nodes, root) as c:
        c.connect(logging_level="ERROR", log_to_driver=False)
        try:
            yield {"cluster": c, "path": path, "shared": shared, "logs": tmp_path_factory.mktemp("logs")}
        finally:
            c.disconnect()
    shutil.rmtree(root, ignore_errors=True)


def _policy(env, name: str, cpus: float, placement: str, **layout) -> WorkerGroup:
    return WorkerGroup("policy", PolicyWorker, **layout, name=name, num_cpus_per_worker=cpus, placement=placement,
                       timeout_s=120, log_dir=env["logs"],
                       init_kwargs={"model_path": env["path"], "micro_batch_size": 4,
                                    "optim": {**OPTIM, "use_distributed_optimizer": False}})


def _update(group: WorkerGroup, batch) -> tuple[dict, dict]:
    metrics = group.train_step(batch, LOSS, micro_batch_size=2)
    return metrics, fetch_state_dict(group.state_dict_for_rollout(bucket_mb=1.0))


# `slow` (40 s in make test): a refusal; the two multi-node runs beside it stay in make test
@pytest.mark.slow
def test_run_dir_must_be_shared_by_every_node(cluster):
    check_shared_run_dir(cluster["shared"] / "run")  # every node sees it
    assert not (cluster["shared"] / "run" / ".node-check").exists()  # the probe files are removed
    if ROOT_ONLY:
        pytest.skip("node c's private tmpfs needs root (unshare -m)")
    with pytest.raises(UserError, match=r"trainer.output_dir: .*unshared/run is not on storage every node shares: "
                                        r"node 127\.0\.0\.4 \(\w{8}\) cannot read the driver's file"):
        check_shared_run_dir(cluster["shared"] / "unshared" / "run")


def test_impossible_placements_fail_at_once_naming_the_nodes(cluster):
    """Three bundles of 1.5 CPUs on nodes of their own: only a and b can hold one; all four ranks of a TP4
    group in one bundle of 2.5 CPUs: no node has that much. Both refused before any actor starts."""
    t0 = time.monotonic()
    with pytest.raises(ResourceUnavailableError, match=r"strict_spread puts each of its 3 bundle\(s\) of "
                                                       r"\{CPU=1.5\} on a node of its own, but only 2 node\(s\)"):
        _policy(cluster, "policy-too-spread", 1.5, "strict_spread", dp=3)
    with pytest.raises(ResourceUnavailableError, match=r"one bundle asks for 2.5 CPU but no node has that much"):
        _policy(cluster, "policy-tp-too-big", 0.625, "pack", tp=4)
    assert time.monotonic() - t0 < 10
    assert not [n for n in ray.util.list_named_actors() if n.startswith("policy-t")]


def test_tp2_dp2_across_two_nodes_gives_the_one_node_update(cluster):
    """strict_pack: all four ranks on one node; strict_spread: each TP pair on its own node (the TP group
    shares one bundle), so the DP replicas talk across nodes. Same weights, same batch, same update."""
    batch = make_rl_batch(n=8, seed=3)
    one = _policy(cluster, "policy-one-node", 0.5, "strict_pack", tp=2, dp=2)
    try:
        assert len({i["node_id"] for i in one.infos}) == 1
        batch["old_logprobs"] = one.compute_logprobs(batch)["logprobs"]
        ref_metrics, ref = _update(one, batch)
    finally:
        one.shutdown()
    two = _policy(cluster, "policy-two-nodes", 0.5, "strict_spread", tp=2, dp=2)
    try:
        nodes = [i["node_ip"] for i in two.infos]
        assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2], nodes  # TP inside a node
        assert all(n.endswith(f"@{ip}") for n, ip in zip(two.names, nodes, strict=True)), two.names
        log = two.log_path(2).read_text()
        assert f"node {nodes[2]}" in log and f"[{two.names[2]}]" in log  # the rank's log lines name its node
        metrics, got = _update(two, batch)
    finally:
        two.shutdown()
    diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
    assert diff <= 1e-6, diff
    for key in ("loss", "grad_norm", "clipfrac"):
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-6, abs=1e-7), key


def test_weight_sync_from_two_nodes_into_an_engine_on_a_third_then_a_lost_node_is_named(cluster, tmp_path):
    """Policy DP2 on a and b (1.5 CPUs a rank), the engine on the head: gloo is chosen (not shared memory) and
    the first sync is verified; after a train step the engine matches the policy again. Then node b is
    killed: the next call names the node and every rank lost with it within 30 s."""
    policy = _policy(cluster, "policy", 1.5, "strict_spread", dp=2)
    engine = None
    try:
        engine = RolloutGroup(EngineConfig(model_path=cluster["path"], kv_cache_gb=0.05, max_num_seqs=32, num_cpus=1,
                                           work_dir=str(tmp_path / "rollout")), name="rollout",
                              timeout_s=300, log_dir=cluster["logs"])
        head, policy_nodes = engine.infos[0]["node_ip"], {i["node_ip"] for i in policy.infos}
        assert head == "127.0.0.10" and policy_nodes == {"127.0.0.2", "127.0.0.3"}, (head, policy_nodes)
        assert engine.names == ["rollout/0@127.0.0.10"]
        stats = engine.sync_weights(policy, SyncConfig(timeout_s=60), verify=True)
        syncer = engine._syncers[id(policy)]
        assert syncer.transport.name == "gloo" and set(syncer.nodes) == {head, *policy_nodes}, syncer.nodes
        assert stats["mismatch/canary_max_abs_diff"] <= 1e-3
        batch = make_rl_batch(n=8, seed=4, vocab=int(engine.vocab_size))
        batch["old_logprobs"] = policy.compute_logprobs(batch)["logprobs"]
        policy.train_step(batch, LOSS)
        assert engine.sync_weights(policy, SyncConfig(timeout_s=60), verify=True)["mismatch/canary_max_abs_diff"] <= 1e-3

        victim = next(r for r, i in enumerate(policy.infos) if i["node_ip"] == "127.0.0.3")
        cluster["cluster"].kill_node("b")
        t0 = time.monotonic()
        with pytest.raises(NodeLostError) as err:
            policy.compute_logprobs(batch)
        assert time.monotonic() - t0 < 30
        msg = str(err.value)
        assert "node 127.0.0.3" in msg and "left the cluster" in msg, msg
        assert f"lost with it: policy rank {victim} ({policy.names[victim]})" in msg, msg
        assert "rollout" not in msg.split("lost with it:")[1].split("\n")[0]  # the engine on the head is not lost
        assert torch.isfinite(torch.tensor(engine.score_all([[1, 2, 3]])[0][0])).all()  # the head still serves
    finally:
        policy.shutdown()
        if engine is not None:
            engine.shutdown()
