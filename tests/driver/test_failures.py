"""A worker killed mid-run stops the driver fast with the role named, and --resume continues from the last checkpoint."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_rl_e2e import FAST


def _steps(run: Path) -> list[int]:
    f = run / "metrics.jsonl"
    return [json.loads(x)["step"] for x in f.read_text().splitlines()] if f.exists() else []


@pytest.mark.slow
def test_killed_worker_is_reported_and_run_resumes(tmp_path):
    run = tmp_path / "run"
    args = [sys.executable, "-m", "rlhf", "train", "configs/grpo_tiny.yaml", *FAST, "trainer.val_every=0",
            "data.val_size=4", "trainer.export_hf=false", "trainer.save_every=2", "trainer.total_steps=200",
            f"trainer.output_dir={run}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.time() + 600
        while max(_steps(run), default=0) < 3:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.time() < deadline, "the run did not reach step 3"
            time.sleep(1)
        log = (run / "logs" / "policy" / "dp0-tp0-pp0.log").read_text()
        pid = int(re.search(r"started: pid (\d+)", log).group(1))
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        _, err = proc.communicate(timeout=120)
        assert time.time() - killed_at < 30, "the driver took too long to notice the dead worker"
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "policy" in err and "Traceback" not in err.split("error:")[-1], err[-3000:]
    last_ckpt = int((run / "checkpoints" / "latest").read_text().strip().split("-")[1])
    assert last_ckpt >= 2 and not list((run / "checkpoints").glob("tmp-*/driver_state.json"))

    resumed = subprocess.run(args[:-2] + ["trainer.total_steps=" + str(last_ckpt + 2), f"trainer.output_dir={run}",
                                          "--resume"], capture_output=True, text=True, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step-{last_ckpt:06d} at step {last_ckpt}" in resumed.stdout  # only the steps since it are redone
    assert _steps(run)[-2:] == [last_ckpt + 1, last_ckpt + 2]
