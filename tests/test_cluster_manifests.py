"""The cluster examples: `deploy/kuberay-rayjob.yaml`, `deploy/ray-cluster.yaml` and `docs/cluster.md`.

Pure YAML and text checks: the manifests' structure, the run directory on the storage every node mounts, a
private dashboard with token authentication, the pinned worker port range the docs name, and every
`section.field=value` override that the docs or the RayJob's entrypoint show exists in the config schema.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlhf.config import load_config
from rlhf.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "cluster.md"
RAYJOB = REPO / "deploy" / "kuberay-rayjob.yaml"
CLUSTER = REPO / "deploy" / "ray-cluster.yaml"
SHARED = "/shared"  # where both examples mount the shared run storage
LOOPBACK = "127.0.0.1"

# `section.field=value` as written in the docs and on a command line (not `--flag=value` or `ENV_VAR=value`)
OVERRIDE = re.compile(r"(?<![\w.$/<>-])([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)=([^\s`'\"\\]+)")


def _yaml(path: Path) -> dict[str, Any]:
    assert path.is_file(), f"{path.relative_to(REPO)} is missing"
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), f"{path.relative_to(REPO)} must hold one YAML mapping"
    return data


@pytest.fixture(scope="module")
def rayjob() -> dict[str, Any]:
    return _yaml(RAYJOB)


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    return _yaml(CLUSTER)


@pytest.fixture(scope="module")
def doc() -> str:
    assert DOC.is_file(), "docs/cluster.md is missing"
    return DOC.read_text()


def _head(rayjob: dict[str, Any]) -> dict[str, Any]:
    return rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]


def _worker_groups(rayjob: dict[str, Any]) -> list[dict[str, Any]]:
    return rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]


def _pvc_mounts(group: dict[str, Any], who: str) -> set[tuple[str, str]]:
    """(claim name, mount path) of every PersistentVolumeClaim mounted in the group's Ray container."""
    pod = group["template"]["spec"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", [])
              if "persistentVolumeClaim" in v}
    container = pod["containers"][0]  # KubeRay runs Ray in the first container
    assert container.get("image"), f"{who}: its Ray container has no image"
    return {(claims[m["name"]], m["mountPath"]) for m in container.get("volumeMounts", []) if m["name"] in claims}


def _train_command(command: str, who: str) -> tuple[str, list[str]]:
    """The config file and the KEY=VALUE overrides of an `rlhf train` / `python -m rlhf train` command."""
    words = shlex.split(command)
    for i, word in enumerate(words[:-2]):
        if (word == "rlhf" or word.endswith("/rlhf")) and words[i + 1] == "train":
            rest = words[i + 2:]
            return rest[0], [w for w in rest[1:] if "=" in w and not w.startswith("-")]
    raise AssertionError(f"{who}: {command!r} does not run `rlhf train CONFIG ...`")


def _ray_start(commands: list[str], who: str, head: bool) -> tuple[list[str], dict[str, str]]:
    """The words and the --flags of the one `ray start` command in `commands` (the head's with --head)."""
    found = []
    for command in commands:
        words = shlex.split(command)
        if any((w == "ray" or w.endswith("/ray")) and words[i + 1:i + 2] == ["start"] for i, w in enumerate(words)):
            found.append(words)
    assert len(found) == 1, f"{who}: expected one `ray start` command, found {len(found)}"
    words, flags = found[0], {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            key, eq, value = word[2:].partition("=")
            if not eq and i + 1 < len(words) and not words[i + 1].startswith("--"):
                value = words[i + 1]
            flags[key] = value
    assert ("head" in flags) == head, f"{who}: `ray start` {'lacks' if head else 'must not have'} --head"
    return words, flags


def _doc_port_range(doc: str) -> tuple[str, str]:
    lows = set(re.findall(r"--min-worker-port[= ](\d+)", doc))
    highs = set(re.findall(r"--max-worker-port[= ](\d+)", doc))
    assert len(lows) == 1 and len(highs) == 1, (
        f"docs/cluster.md must name one worker port range (--min-worker-port / --max-worker-port), "
        f"found {sorted(lows)} / {sorted(highs)}")
    return lows.pop(), highs.pop()


# ---- the KubeRay RayJob ----------------------------------------------------------------------------------
def test_rayjob_is_a_rayjob_that_cleans_up(rayjob):
    assert rayjob.get("apiVersion") == "ray.io/v1", f"RayJob apiVersion is {rayjob.get('apiVersion')!r}, not ray.io/v1"
    assert rayjob.get("kind") == "RayJob", f"kind is {rayjob.get('kind')!r}, not RayJob"
    spec = rayjob["spec"]
    assert spec.get("shutdownAfterJobFinishes") is True, "the RayJob must set shutdownAfterJobFinishes: true"
    ttl = spec.get("ttlSecondsAfterFinished")
    assert isinstance(ttl, int) and ttl >= 0, f"ttlSecondsAfterFinished must be a number of seconds, got {ttl!r}"
    assert "headGroupSpec" in spec.get("rayClusterSpec", {}), "the RayJob has no rayClusterSpec.headGroupSpec"
    assert "num-cpus" in _head(rayjob).get("rayStartParams", {}), "the head's rayStartParams must set num-cpus"
    groups = _worker_groups(rayjob)
    assert groups, "the RayJob's rayClusterSpec has no workerGroupSpecs"
    for g in groups:
        name = g.get("groupName")
        assert name, f"a worker group has no groupName: {sorted(g)}"
        sizes = [g.get(k) for k in ("minReplicas", "replicas", "maxReplicas")]
        assert all(isinstance(n, int) for n in sizes) and sizes == sorted(sizes), (
            f"worker group {name!r}: need minReplicas <= replicas <= maxReplicas, got {sizes}")


def test_rayjob_entrypoint_trains_a_repo_config_into_shared_storage(rayjob):
    config, overrides = _train_command(rayjob["spec"].get("entrypoint", ""), "RayJob entrypoint")
    assert "configs/" in config and (REPO / "configs" / Path(config).name).is_file(), (
        f"RayJob entrypoint: config {config!r} is not a file of the repository's configs/")
    out = [o.split("=", 1)[1] for o in overrides if o.startswith("trainer.output_dir=")]
    assert out, "RayJob entrypoint: no trainer.output_dir=...: the run dir would be in the job's working dir"
    assert out[-1].startswith(SHARED + "/"), (
        f"RayJob entrypoint: trainer.output_dir={out[-1]} is not under the shared mount {SHARED}")


def test_rayjob_head_and_workers_mount_the_same_shared_volume(rayjob, doc):
    head = _pvc_mounts(_head(rayjob), "head")
    shared = {(claim, path) for claim, path in head if path == SHARED}
    assert shared, f"the head mounts no PersistentVolumeClaim at {SHARED} (mounts: {sorted(head)})"
    for g in _worker_groups(rayjob):
        mounts = _pvc_mounts(g, f"worker group {g.get('groupName')!r}")
        assert shared <= mounts, (
            f"worker group {g.get('groupName')!r} mounts {sorted(mounts)}, not the head's shared volume {sorted(shared)}")
    # the claim docs/cluster.md tells you to create: that name, ReadWriteMany
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", doc, re.S)]
    pvcs = {b["metadata"]["name"]: b for b in blocks if isinstance(b, dict) and b.get("kind") == "PersistentVolumeClaim"}
    for claim, _ in shared:
        assert claim in pvcs, f"docs/cluster.md shows no PersistentVolumeClaim named {claim!r}"
        modes = pvcs[claim]["spec"].get("accessModes", [])
        assert "ReadWriteMany" in modes, f"docs/cluster.md: claim {claim!r} has accessModes {modes}, not ReadWriteMany"


def test_rayjob_dashboard_stays_inside_the_cluster(rayjob, doc):
    head, spec = _head(rayjob), rayjob["spec"]["rayClusterSpec"]
    assert head.get("serviceType", "ClusterIP") == "ClusterIP", (
        f"the head Service is {head['serviceType']!r}: it would expose the dashboard outside the cluster")
    assert not head.get("enableIngress"), "the head has enableIngress: the dashboard would be reachable from outside"
    mode = (spec.get("authOptions") or {}).get("mode")
    assert mode == "token", f"rayClusterSpec.authOptions.mode is {mode!r}: Ray token authentication must be on"
    host = head.get("rayStartParams", {}).get("dashboard-host")
    assert host in (LOOPBACK, "0.0.0.0"), f"the head's dashboard-host is {host!r}"
    assert f'dashboard-host: "{host}"' in doc or f"--dashboard-host {host}" in doc, (
        f"docs/cluster.md does not explain the RayJob's dashboard-host {host}")


# ---- the autoscaler cluster config ----------------------------------------------------------------------
def test_ray_cluster_has_the_autoscaler_keys(cluster):
    for key in ("cluster_name", "max_workers", "provider", "auth", "available_node_types", "head_node_type",
                "head_start_ray_commands", "worker_start_ray_commands"):
        assert key in cluster, f"deploy/ray-cluster.yaml lacks the autoscaler key {key!r}"
    assert cluster["provider"].get("type"), "deploy/ray-cluster.yaml: provider has no type (aws, gcp, ...)"
    types = cluster["available_node_types"]
    assert cluster["head_node_type"] in types, (
        f"head_node_type {cluster['head_node_type']!r} is not one of available_node_types {sorted(types)}")
    assert len(types) >= 2, f"available_node_types must hold a head type and a worker type, got {sorted(types)}"
    for name, node_type in types.items():
        for key in ("resources", "node_config", "min_workers", "max_workers"):
            assert key in node_type, f"node type {name!r} lacks {key!r}"
        assert node_type["min_workers"] <= node_type["max_workers"] <= cluster["max_workers"], (
            f"node type {name!r}: need min_workers <= max_workers <= the cluster's max_workers")


def test_ray_cluster_installs_the_package_and_mounts_shared_storage(cluster):
    setup = cluster.get("setup_commands", []) + cluster.get("head_setup_commands", [])
    repo_paths = [remote for remote, local in cluster.get("file_mounts", {}).items() if local in (".", "./")]
    assert repo_paths, "deploy/ray-cluster.yaml: no file_mounts entry copies the repository ('.')"
    assert any("pip install" in c and any(p in c for p in repo_paths) for c in setup), (
        f"deploy/ray-cluster.yaml: no setup command pip-installs the copied repository {repo_paths}")
    assert any(" mount " in f" {c} " and SHARED in c for c in cluster.get("setup_commands", [])), (
        f"deploy/ray-cluster.yaml: no setup command (run on every node) mounts the shared storage at {SHARED}")


def test_ray_cluster_dashboard_on_loopback_and_workers_join_the_gcs(cluster):
    head_words, head = _ray_start(cluster["head_start_ray_commands"], "head_start_ray_commands", head=True)
    assert head.get("dashboard-host") == LOOPBACK, (
        f"the head starts the dashboard on {head.get('dashboard-host')!r}, not {LOOPBACK}")
    gcs_port = head.get("port", "6379")
    worker_words, worker = _ray_start(cluster["worker_start_ray_commands"], "worker_start_ray_commands", head=False)
    assert worker.get("address") == f"$RAY_HEAD_IP:{gcs_port}", (
        f"workers join {worker.get('address')!r}, not the head's GCS at $RAY_HEAD_IP:{gcs_port}")
    for who, words in (("head", head_words), ("worker", worker_words)):
        assert "RAY_AUTH_MODE=token" in words, f"the {who} starts Ray without RAY_AUTH_MODE=token"
        assert not any("0.0.0.0" in w for w in words), f"the {who}'s `ray start` binds something to 0.0.0.0"
    assert "~/.ray/auth_token" in cluster.get("file_mounts", {}).values(), (
        "deploy/ray-cluster.yaml does not copy ~/.ray/auth_token: the nodes would not share one token")


def test_worker_port_range_is_the_one_the_docs_name(cluster, rayjob, doc):
    low, high = _doc_port_range(doc)
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        _, flags = _ray_start(cluster[key], key, head=key.startswith("head"))
        got = (flags.get("min-worker-port"), flags.get("max-worker-port"))
        assert got == (low, high), f"deploy/ray-cluster.yaml {key}: worker ports {got}, docs/cluster.md says {(low, high)}"
    for who, group in [("head", _head(rayjob))] + [(f"worker group {g.get('groupName')!r}", g)
                                                   for g in _worker_groups(rayjob)]:
        params = group.get("rayStartParams", {})
        got = (params.get("min-worker-port"), params.get("max-worker-port"))
        assert got == (low, high), f"deploy/kuberay-rayjob.yaml {who}: worker ports {got}, docs/cluster.md says {(low, high)}"


# ---- the overrides the docs show ------------------------------------------------------------------------
def test_every_override_shown_exists_in_the_schema(rayjob, doc):
    _, entry = _train_command(rayjob["spec"]["entrypoint"], "RayJob entrypoint")
    shown = {f"{k}={v}": "docs/cluster.md" for k, v in OVERRIDE.findall(doc)}
    shown.update({o: "the RayJob entrypoint" for o in entry})
    assert any(o.startswith("trainer.output_dir=") for o in shown), "found no trainer.output_dir=... override"
    for override, where in sorted(shown.items()):
        key = override.split("=", 1)[0]
        if key == "trainer.output_dir":
            assert override.split("=", 1)[1].startswith(SHARED + "/"), (
                f"{where}: {override} is not under the shared mount {SHARED}")
        try:
            load_config(None, [override], validate=False)
        except ConfigError as e:
            raise AssertionError(f"{where} shows the override {override}, which the config rejects: {e}") from None
