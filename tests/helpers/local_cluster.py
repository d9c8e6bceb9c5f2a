"""A Ray cluster of several nodes on one machine: a head and worker nodes, each its own raylet on its own
loopback address (127.0.0.x; Linux routes all of 127.0.0.0/8 to the loopback interface), temp dir and ports,
with a custom resource `node_<name>` to pin work to it. Placement, cross-node transports and node failures
then run for real; the traffic between nodes stays on loopback. For tests and benches:

    with LocalCluster([NodeSpec("head", "127.0.0.10", 2), NodeSpec("a", "127.0.0.2", 2)], root) as c:
        c.connect()                 # ray.init with the cluster's own token (c.disconnect() to leave)
        ...
        c.kill_node("a")            # SIGKILL the node's raylet and everything it started

Every process is started and stopped by PID (found by the node's temp dir in its command line, and the
children of those); `ray stop` is never used. A node may hide folders from its processes behind a private
tmpfs (`NodeSpec.private_dirs`, root only: `unshare -m`), to stand for a node that does not share storage.
Ray in cluster mode binds some of its own servers (GCS, raylets, agents) to all interfaces whatever
address a node has; keep such clusters on machines without untrusted networks.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_PORT_FLAGS = ("--node-manager-port", "--object-manager-port", "--metrics-export-port",
               "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port")


@dataclass
class NodeSpec:
    """One node: a name (its resource `node_<name>`), a 127.x address, its logical CPUs, folders it must not
    see as the others do (a private tmpfs over each)."""

    name: str
    ip: str
    num_cpus: float
    private_dirs: list[str] = field(default_factory=list)


def free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def pids_with(marker: str) -> list[int]:
    """The processes whose command line contains `marker` (a node's temp dir), and their descendants."""
    import psutil

    found: set[int] = set()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if marker in " ".join(proc.info["cmdline"] or []):
                found.add(proc.pid)
                found.update(c.pid for c in proc.children(recursive=True))
        except psutil.Error:
            pass
    found.discard(os.getpid())
    return sorted(found)


def kill_pids(pids: list[int], grace_s: float = 2.0) -> None:
    """SIGTERM `pids`, then SIGKILL what is left after `grace_s` (0: SIGKILL at once)."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM if grace_s else signal.SIGKILL)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s or 0.1)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass


def _refresh_auth() -> None:
    """Make Ray re-read RAY_AUTH_MODE and the token file in this process."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


class LocalCluster:
    """The head (`nodes[0]`) and worker nodes of `nodes`, under `root` (short: Ray's socket paths are bounded)."""

    def __init__(self, nodes: list[NodeSpec], root: str | Path, start_timeout_s: float = 120.0) -> None:
        self.nodes = {n.name: n for n in nodes}
        self.head = nodes[0]
        self.root = Path(root)
        self.timeout_s = start_timeout_s
        self.port = free_port(self.head.ip)
        self.address = f"{self.head.ip}:{self.port}"
        self.ray_bin = str(Path(sys.executable).parent / "ray")
        self.token_path = self.root / "auth_token"
        self.env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1", RAY_USAGE_STATS_ENABLED="0",
                        **self.client_env())
        self.env.pop("RAY_ADDRESS", None)

    def client_env(self) -> dict[str, str]:
        """What a process that joins the cluster needs in its environment: token authentication with the
        cluster's own token file (not the user's ~/.ray/auth_token)."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path)}

    def connect(self, **init_kwargs: Any) -> None:
        """`ray.init` into this cluster from this process, with the cluster's token. Ray caches a process's
        authentication settings when it first reads them, so they are refreshed here (and in `disconnect`)."""
        import ray

        self._saved_env = {k: os.environ.get(k) for k in self.client_env()}
        os.environ.update(self.client_env())
        _refresh_auth()
        ray.init(address=self.address, **init_kwargs)

    def disconnect(self) -> None:
        """`ray.shutdown` and this process's authentication settings as they were before `connect`."""
        import ray

        ray.shutdown()
        for key, value in getattr(self, "_saved_env", {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _refresh_auth()

    def temp_dir(self, name: str) -> Path:
        return self.root / name

    def start(self) -> LocalCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            for spec in self.nodes.values():
                self.start_node(spec.name)
        except BaseException:
            self.stop()
            raise
        return self

    def start_node(self, name: str) -> None:
        """Start node `name` (the head first) and wait until `ray start` returns."""
        spec = self.nodes[name]
        temp = self.temp_dir(name)
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir(parents=True)
        cmd = [self.ray_bin, "start", "--node-ip-address", spec.ip, "--temp-dir", str(temp),
               "--num-cpus", f"{spec.num_cpus:g}", "--resources", f'{{"node_{name}": 1}}', "--disable-usage-stats"]
        for flag in _PORT_FLAGS:
            cmd += [flag, str(free_port(spec.ip))]
        if spec is self.head:
            cmd += ["--head", "--port", str(self.port), "--include-dashboard", "false",
                    "--ray-client-server-port", str(free_port(spec.ip))]
        else:
            cmd += ["--address", self.address]
        if spec.private_dirs:
            mounts = " && ".join(f"mount -t tmpfs tmpfs {d}" for d in spec.private_dirs)
            cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "sh", *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s, env=self.env)
        if out.returncode != 0:
            raise RuntimeError(f"node {name} ({spec.ip}) did not start: {out.stderr[-2000:]}")

    def node_pids(self, name: str) -> list[int]:
        return pids_with(f"{self.temp_dir(name)}/")

    def kill_node(self, name: str) -> None:
        """SIGKILL node `name`'s raylet and every process it started (a machine that is gone)."""
        kill_pids(self.node_pids(name), grace_s=0)

    def stop(self) -> None:
        """Stop every node, workers first, by PID."""
        for name in [*list(self.nodes)[1:], self.head.name]:
            kill_pids(self.node_pids(name))

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
