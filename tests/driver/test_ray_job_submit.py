"""`ray job submit` against a local head this test starts (own temp dir and ports), stopped by PID."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


@pytest.mark.slow
def test_ray_job_submit_runs_grpo(tmp_path):
    from ray.job_submission import JobStatus, JobSubmissionClient

    temp_dir = Path("/tmp") / f"rlhf-ray-{os.getpid()}"  # short: Ray's socket paths have a length limit
    port, dash = _free_port(), _free_port()
    ray_bin = str(Path(sys.executable).parent / "ray")
    start = subprocess.run(
        [ray_bin, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash), "--temp-dir", str(temp_dir),
         "--num-cpus", "4", "--include-dashboard", "true", "--disable-usage-stats"],
        capture_output=True, text=True, timeout=180)
    try:
        assert start.returncode == 0, start.stderr[-3000:]
        client = JobSubmissionClient(f"http://127.0.0.1:{dash}")
        run = tmp_path / "job_run"
        entry = (f"{sys.executable} -m rlhf train configs/grpo_tiny.yaml model.warm_start_steps=5 "
                 "data.val_size=8 data.prompts_per_step=4 rollout.n=4 policy.micro_batch_size=8 "
                 f"trainer.total_steps=2 trainer.progress_bar=false trainer.output_dir={run}")
        job = client.submit_job(entrypoint=entry, runtime_env={"working_dir": str(REPO),
                                                               "excludes": [".venv", "runs", ".git"]})
        deadline = time.time() + 600
        while client.get_job_status(job) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
            assert time.time() < deadline, "job did not finish"
            time.sleep(2)
        logs = client.get_job_logs(job)
        assert client.get_job_status(job) == JobStatus.SUCCEEDED, logs[-4000:]
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
