"""The embedded Ray stays private: loopback-only sockets, a 0600 token, its temp dir under the run (or a
scratch one removed at exit), the dashboard's token and metrics hints, and no stale weight-sync files."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers.net import loopback

REPO = Path(__file__).resolve().parents[2]


def _start_ray(dashboard: bool) -> str:
    """Script lines that start the run's embedded Ray (output_dir from argv[1]) as `own`, and a worker with an
    actor on it."""
    return f"""
import json, os, sys, time, psutil, ray
from rlhf.config.schema import TrainerConfig
from rlhf.driver.infra.ray_env import init_ray, token_path

own = init_ray(TrainerConfig(output_dir=sys.argv[1], dashboard={dashboard}, ray_num_cpus=2))
@ray.remote
class A:
    def pid(self):
        return os.getpid()
    def env(self):
        return {{k: os.environ.get(k) for k in ("TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}}
    def runtime_env(self):
        return dict(ray.get_runtime_context().runtime_env)
a = A.remote()
ray.get(a.pid.remote(), timeout=120)
"""


# Runs in its own process (a test session may already hold a Ray instance): start the run's Ray with the
# dashboard, start a worker and an actor, list every listening socket of the processes Ray started.
SCRIPT = _start_ray(dashboard=True) + """listen = []
for p in psutil.Process().children(recursive=True):
    try:
        listen += [[p.pid, p.name(), c.laddr.ip, c.laddr.port] for c in p.net_connections(kind="inet")
                   if c.status == psutil.CONN_LISTEN]
    except psutil.Error:
        pass
node_ip = ray.util.get_node_ip_address()
import urllib.request  # the metrics export port answers without the token (as docs/security.md says)
port = ray._private.worker._global_node.metrics_export_port
metrics_open = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).status == 200
temp_dir = str(own.temp_dir)
worker_env = ray.get(a.env.remote(), timeout=60)
driver_env = {k: os.environ.get(k) for k in worker_env}
runtime_env = ray.get(a.runtime_env.remote(), timeout=60)
own.stop()
print("RESULT", json.dumps({"listen": listen, "node_ip": node_ip, "temp_dir": temp_dir, "metrics_open": metrics_open,
                            "token": str(token_path()), "scratch_left": os.path.exists(temp_dir), "worker_env": worker_env,
                            "driver_env": driver_env, "runtime_env": runtime_env}))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["run_dir", "long_run_dir"])
def test_embedded_ray_listens_on_loopback_only(where, tmp_path):
    home = Path(tempfile.mkdtemp(prefix="h", dir="/tmp"))  # a short path: Ray's sockets fit under it
    stale_shm = Path("/dev/shm") / "rlhf-wsync-999999999-test.bin"  # left by a killed driver (no such pid)
    try:
        stale_shm.write_bytes(b"x")
        out = home / "run" if where == "run_dir" else tmp_path / ("x" * 60) / "run"
        env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(home), "RAY_AUTH_MODE": "token"}
        env.pop("RAY_AUTH_TOKEN_PATH", None)
        for name in ("RAY_ADDRESS", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            env.pop(name, None)
        proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], env=env, capture_output=True, text=True,
                              timeout=280)
        assert proc.returncode == 0, proc.stderr[-3000:]
        res = json.loads(proc.stdout.split("RESULT ", 1)[1])
        assert res["node_ip"] == "127.0.0.1"
        # the workers inherit these from the embedded Ray's processes (no job runtime_env: each worker would
        # start through Ray's setup_worker, a second interpreter and Ray import); the driver's own are untouched
        assert res["worker_env"] == {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                                     "HF_DATASETS_OFFLINE": "1"}, res["worker_env"]
        assert set(res["driver_env"].values()) == {None}, res["driver_env"]
        assert res["runtime_env"] == {}, res["runtime_env"]
        assert res["metrics_open"], "docs/security.md says the metrics export port answers without a token"
        assert not stale_shm.exists(), "the start did not remove a dead driver's weight-sync file"
        assert len(res["listen"]) >= 5, res["listen"]  # GCS, raylet, agents, dashboard, the actor's worker
        names = " ".join(r[1] for r in res["listen"])
        assert "gcs_server" in names and "raylet" in names
        exposed = [r for r in res["listen"] if not loopback(r[2])]
        assert not exposed, f"listening beyond loopback: {exposed}"
        token = Path(res["token"])
        assert token == home / ".ray" / "auth_token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        assert "ray get-auth-token" in proc.stdout and str(token) in proc.stdout
        assert "Prometheus" in proc.stdout and "report.png" in proc.stdout
        if where == "run_dir":
            assert res["temp_dir"] == str(out / "ray" / "tmp") and res["scratch_left"]
            assert list((out / "ray" / "tmp").glob("session_*/logs")), "Ray's session folder is not under the run dir"
        else:  # the run dir is too long for Ray's unix sockets: a scratch dir in /tmp, removed at exit
            assert res["temp_dir"].startswith("/tmp/rlhf-eray-") and not res["scratch_left"]
    finally:
        shutil.rmtree(home, ignore_errors=True)
        stale_shm.unlink(missing_ok=True)


def test_existing_token_made_private_and_stale_scratch_dirs_removed(tmp_path, monkeypatch):
    from rlhf.driver.infra import ray_env

    token = tmp_path / "tok"
    token.write_text("abc")
    token.chmod(0o644)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
    assert ray_env.ensure_private_token() == token
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and token.read_text() == "abc"
    token.unlink()
    ray_env.ensure_private_token()
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) == 64

    dead = 999_999_999  # no such pid
    stale = tmp_path / f"{ray_env.SCRATCH_PREFIX}{dead}-abc"
    live = tmp_path / f"{ray_env.SCRATCH_PREFIX}{os.getpid()}-def"
    stale.mkdir()
    live.mkdir()
    assert ray_env.remove_stale_scratch_dirs(str(tmp_path)) == [str(stale)]
    assert live.exists()

    long_dir, scratch = ray_env.ray_temp_dir(tmp_path / ("y" * 80))
    try:
        assert scratch and len(str(long_dir)) + ray_env.SESSION_SUFFIX_MAX <= ray_env.SOCKET_PATH_MAX
    finally:
        shutil.rmtree(long_dir.parent)


# A driver that starts its embedded Ray (in a scratch temp dir: the run dir is too long), an actor and a
# weight-sync file, reports what Ray started, then waits to be killed.
KILLED_DRIVER = _start_ray(dashboard=False) + """from workers.rollout.cpu.shm_file import PREFIX, SHM_DIR
shm = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-test.bin")
open(shm, "wb").write(b"w")
started = [[p.pid, p.name()] for p in psutil.Process().children(recursive=True) if p.pid != getattr(own.reaper, "pid", None)]
print("STARTED", json.dumps({"processes": started, "shm": shm, "temp_dir": str(own.temp_dir)}), flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(300)
def test_sigkilled_driver_leaves_no_ray_process_or_file(tmp_path):
    """Ray's agents outlive a SIGKILLed driver by about a minute on their own; the reaper ends them (and
    every other process Ray started) within seconds and removes the driver's shm file and scratch dir."""
    import psutil

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    out = tmp_path / ("x" * 60) / "run"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_DRIVER, str(out)], env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        line = next((ln for ln in proc.stdout if ln.startswith("STARTED ")), "")
        assert line, "the driver did not start"
        res = json.loads(line.split(" ", 1)[1])
        names = " ".join(n for _, n in res["processes"])
        assert "raylet" in names and "DashboardAgent" in names and "RuntimeEnvAgent" in names, names
        assert os.path.exists(res["shm"]) and os.path.isdir(res["temp_dir"])
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 20  # Ray alone: the agents linger about 60 s
    alive = res["processes"]
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = [[pid, name] for pid, name in alive if psutil.pid_exists(pid)
                 and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"still running 20 s after the driver's SIGKILL: {alive}"
    assert not os.path.exists(res["shm"]), "the dead driver's weight-sync file was left"
    assert not os.path.exists(res["temp_dir"]), "the dead driver's scratch Ray dir was left"
