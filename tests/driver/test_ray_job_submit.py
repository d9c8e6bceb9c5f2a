"""`ray job submit` against a local head this test starts (own temp dir and ports, loopback only), stopped by PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.net import loopback

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pids_with(marker: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if marker in (d / "cmdline").read_bytes().decode(errors="ignore"):
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def _non_loopback_listeners(pids: list[int]) -> list[tuple]:
    import psutil

    out = []
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="inet")
        except psutil.Error:
            continue
        out += [(pid, c.laddr) for c in conns if c.status == psutil.CONN_LISTEN and not loopback(c.laddr.ip)]
    return out


CLIENT = """
import sys, time
from ray.job_submission import JobStatus, JobSubmissionClient
client = JobSubmissionClient(sys.argv[1])
deadline = time.time() + 300  # hang catchers (the job takes ~1.5 min on 2 cores)
while True:  # the head's job agent comes up a little after `ray start` returns
    try:
        job = client.submit_job(entrypoint=sys.argv[2], runtime_env={"working_dir": sys.argv[3],
                                                                     "excludes": [".venv", "runs", ".git"]})
        break
    except RuntimeError as e:
        if "No available agent" not in str(e) or time.time() > deadline:
            raise
        time.sleep(3)
deadline = time.time() + 1200
while client.get_job_status(job) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
    assert time.time() < deadline, f"job {job} did not finish within 1200 s (status {client.get_job_status(job)})"
    time.sleep(2)
print(client.get_job_logs(job))
print("JOB_STATUS", client.get_job_status(job))
"""


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_ray_job_submit_runs_grpo(tmp_path):
    temp_dir = Path("/tmp") / f"rlhf-ray-{os.getpid()}"  # short: Ray's socket paths have a length limit
    port, dash = _free_port(), _free_port()
    # Every port of the head is chosen free: the dashboard agent's default HTTP port (52365) is taken by any
    # other Ray instance on the machine, and then the job agent never registers ("No available agent").
    ports = {flag: str(_free_port()) for flag in (
        "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
        "--runtime-env-agent-port", "--node-manager-port", "--object-manager-port", "--ray-client-server-port")}
    ray_bin = str(Path(sys.executable).parent / "ray")
    start = subprocess.run(
        [ray_bin, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash), "--temp-dir", str(temp_dir),
         "--num-cpus", "4", "--include-dashboard", "true", "--disable-usage-stats",
         *[x for kv in ports.items() for x in kv]],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"))
    try:
        assert start.returncode == 0, start.stderr[-3000:]
        exposed = _non_loopback_listeners(_pids_with(str(temp_dir)))
        assert not exposed, f"the head listens beyond loopback: {exposed}"
        run = tmp_path / "job_run"
        entry = (f"{sys.executable} -m rlhf train configs/grpo_tiny.yaml model.warm_start_steps=5 "
                 "data.val_size=8 data.prompts_per_step=4 rollout.n=4 policy.micro_batch_size=8 "
                 f"trainer.total_steps=2 trainer.progress_bar=false trainer.output_dir={run}")
        # The Jobs SDK client, in a process whose RAY_AUTH_MODE=token makes it send the head's token
        # (~/.ray/auth_token, written by `ray start`).
        client = subprocess.run([sys.executable, "-c", CLIENT, f"http://127.0.0.1:{dash}", entry, str(REPO)],
                                capture_output=True, text=True, timeout=1600, env=dict(os.environ, RAY_AUTH_MODE="token"))
        logs = client.stdout + client.stderr
        assert "JOB_STATUS SUCCEEDED" in client.stdout, logs[-4000:]
        assert (run / "metrics.jsonl").is_file() and (run / "hf" / "config.json").is_file()
        # the run joined the head instead of starting its own Ray
        assert "Connecting to existing Ray cluster" in logs or "Connected to Ray cluster" in logs, logs[-2000:]
    finally:
        for pid in _pids_with(str(temp_dir)):  # stop only this head's processes, by PID
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        time.sleep(2)
        for pid in _pids_with(str(temp_dir)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
