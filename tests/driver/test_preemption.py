"""SIGTERM / SIGINT stop a running `rlhf train` at the next step boundary with a checkpoint, one line and exit
143 / 130, and --resume continues from that checkpoint, logging the same steps as a run that was never
stopped. Without this, Ray's own SIGTERM handler ends the driver mid-step (exit 15, no checkpoint of the
steps since the last periodic one).

Waits are on events (a step logged, the exit), each bounded only to catch a hang (see test_failures)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_failures import HANG_S, _latest_checkpoint, _steps, wait_for
from test_rl_e2e import FAST, metrics

ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")


def _start(args: list[str], tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    err_file = tmp_path / "stderr.txt"
    with (tmp_path / "stdout.txt").open("w") as out, err_file.open("w") as err:
        return subprocess.Popen(args, stdout=out, stderr=err, text=True, env=ENV), err_file


def _stop(proc: subprocess.Popen, sig: int, run: Path, err_file: Path) -> str:
    """Send `sig` once a step was logged; wait for the exit; the driver's last stderr line."""
    try:
        wait_for("the first step in metrics.jsonl", lambda: any(s >= 1 for s in _steps(run)), proc, err_file)
        proc.send_signal(sig)
        wait_for("the driver to exit after the signal", lambda: proc.poll() is not None, proc, err_file,
                 exit_ok=True)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    return err_file.read_text().strip().splitlines()[-1]


@pytest.mark.timeout(3 * HANG_S)
def test_sigterm_checkpoints_at_a_step_boundary_and_resumes(tmp_path):
    run = tmp_path / "run"
    args = [sys.executable, "-m", "rlhf", "train", "configs/grpo_tiny.yaml", *FAST, "trainer.val_every=0",
            "data.val_size=4", "trainer.export_hf=false", "trainer.save_every=0", "trainer.total_steps=100000",
            f"trainer.output_dir={run}"]
    proc, err_file = _start(args, tmp_path)
    last = _stop(proc, signal.SIGTERM, run, err_file)
    assert proc.returncode == 143, err_file.read_text()[-3000:]
    m = re.fullmatch(r"rlhf train: stopped at step (\d+); resume with --resume", last)
    assert m, err_file.read_text()[-3000:]
    step = int(m.group(1))
    assert _latest_checkpoint(run) == step >= 1 and max(_steps(run)) == step  # the step in flight was finished
    assert "Traceback" not in err_file.read_text()

    resumed = subprocess.run([*args[:-2], f"trainer.total_steps={step + 1}", f"trainer.output_dir={run}",
                              "--resume"], capture_output=True, text=True, env=ENV, timeout=HANG_S)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {step}" in resumed.stdout
    assert _steps(run) == sorted(set(_steps(run))) and _steps(run)[-1] == step + 1

    # Resuming is deterministic: stopped at `step` and resumed, the run logs the same steps as one that ran
    # straight through (the loader, KL controller and RNG come back from the checkpoint).
    full = tmp_path / "full"
    r = subprocess.run([*args[:-2], f"trainer.total_steps={step + 1}", f"trainer.output_dir={full}"],
                       capture_output=True, text=True, env=ENV, timeout=HANG_S)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = ({row["step"]: row for row in metrics(d) if row["step"] > 0} for d in (full, run))
    assert sorted(a) == sorted(b) == list(range(1, step + 2))
    for i in a:
        for key in ("reward_mean", "policy_loss", "grad_norm", "response_length_mean"):
            assert a[i][key] == pytest.approx(b[i][key], rel=1e-4, abs=1e-5), (i, key)


@pytest.mark.timeout(3 * HANG_S)
def test_sigint_stops_sft_with_a_checkpoint(tmp_path):
    run = tmp_path / "sft"
    args = [sys.executable, "-m", "rlhf", "train", "configs/sft_tiny.yaml", "trainer.total_steps=100000",
            "trainer.save_every=0", "trainer.val_every=0", "trainer.eval_iters=0", "trainer.export_hf=false",
            "trainer.progress_bar=false", f"trainer.output_dir={run}"]
    proc, err_file = _start(args, tmp_path)
    last = _stop(proc, signal.SIGINT, run, err_file)
    assert proc.returncode == 130, err_file.read_text()[-3000:]
    m = re.fullmatch(r"rlhf train: stopped at step (\d+); resume with --resume", last)
    assert m, err_file.read_text()[-3000:]
    state = json.loads((run / "checkpoints" / f"step-{int(m.group(1)):06d}" / "driver_state.json").read_text())
    assert state["step"] == int(m.group(1)) == max(_steps(run))
