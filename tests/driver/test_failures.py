"""A worker killed mid-run stops the driver with the role named, and --resume continues from the last checkpoint;
a rollout engine killed in the resumed run is reported the same way.

The test waits for events (a checkpoint written, the error line, the exit), never for a fixed time budget,
so it passes on a slow machine: each wait's bound only catches a hang (many times the expected duration;
the whole run takes ~1 minute on 2 cores), and its failure says what it was waiting for. "Noticed the dead
worker" is shown by the message itself (the actor died, named by role, rank and pid), which a timeout-based
stop (`trainer.timeout_s`, 300 s by default) would not print.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.helpers.cli import FAST, cli_env
from tests.helpers.runs import HANG_S, latest_checkpoint, logged_steps, wait_for


@contextlib.contextmanager
def started(cmd: list[str], out_file: Path, err_file: Path, env: dict[str, str]) -> Iterator[subprocess.Popen]:
    """`cmd` running with its output in files (not pipes: a full pipe would block the run), killed on the way
    out if it is still running."""
    with out_file.open("w") as out, err_file.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)


@pytest.mark.slow
@pytest.mark.timeout(3 * HANG_S)
def test_killed_worker_is_reported_and_run_resumes_then_a_killed_engine_too(tmp_path):
    run = tmp_path / "run"
    args = [sys.executable, "-m", "rlhf", "train", "configs/grpo_tiny.yaml", *FAST, "trainer.val_every=0",
            "data.val_size=4", "trainer.export_hf=false", "trainer.save_every=2", "trainer.total_steps=1000",
            f"trainer.output_dir={run}"]
    env = cli_env()
    out_file, err_file = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with started(args, out_file, err_file, env) as proc:
        wait_for("the first checkpoint (step 2)", lambda: latest_checkpoint(run) >= 2, proc, err_file)
        log = run / "logs" / "policy" / "dp0-tp0-pp0.log"
        pid = int(wait_for(f"the policy rank's pid in {log}",
                           lambda: re.search(r"started: pid (\d+)", log.read_text()), proc, err_file).group(1))
        os.kill(pid, signal.SIGKILL)
        error = wait_for("the driver's error line after the policy rank was killed",
                         lambda: re.search(r"^rlhf train: error: .*$", err_file.read_text(), re.M), proc, err_file,
                         exit_ok=True)
        wait_for("the driver to exit after reporting the dead worker", lambda: proc.poll() is not None, proc,
                 err_file, exit_ok=True)
    assert proc.returncode == 2, err_file.read_text()[-3000:]
    line = error.group(0)
    assert "role 'policy' rank 0" in line and f"pid {pid}" in line and "the actor died" in line, line
    assert "Traceback" not in err_file.read_text().split("rlhf train: error:")[-1], err_file.read_text()[-3000:]
    last_ckpt = latest_checkpoint(run)
    assert last_ckpt >= 2 and not list((run / "checkpoints").glob("tmp-*/driver_state.json"))

    before = max(logged_steps(run))  # the last step the killed run logged

    # --resume continues from the last checkpoint. The resumed run is then the run whose rollout engine is
    # killed: reported like a dead worker (role 'rollout', its rank, node and pid), exit code 2.
    out_file, err_file = tmp_path / "resumed_stdout.txt", tmp_path / "resumed_stderr.txt"
    with started([*args, "--resume"], out_file, err_file, env) as proc:
        # a step the killed run never reached: logged by the resumed run (its rows since the checkpoint superseded)
        wait_for(f"the resumed run to log step {max(before, last_ckpt + 1) + 1}",
                 lambda: max(logged_steps(run), default=0) > max(before, last_ckpt + 1), proc, err_file)
        assert f"step-{last_ckpt:06d} at step {last_ckpt}" in out_file.read_text()  # only the steps since it are redone
        steps = logged_steps(run)
        assert steps == sorted(set(steps)) and set(range(1, last_ckpt + 2)) <= set(steps), steps  # each step once
        pids = _engine_pids(proc.pid)
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
        wait_for("the driver to exit after the rollout engine was killed", lambda: proc.poll() is not None, proc,
                 err_file, exit_ok=True)
    err = err_file.read_text()
    assert proc.returncode == 2, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("rlhf train: error:")]
    assert len(lines) == 1, err[-3000:]
    line = lines[0]
    assert re.search(r"role 'rollout' rank 0 \(rollout/0\) on node \S+ \(\w+\), pid " + str(pids[0]), line), line
    assert "name: rollout/0" in err  # Ray's own report of the dead actor: it had the rollout's actor name
    assert "Traceback" not in err[err.index(line):], err[-3000:]


def _engine_pids(driver_pid: int) -> list[int]:
    """The rollout engine actors among the driver's descendants (its embedded Ray), by process title."""
    out = []
    for p in psutil.Process(driver_pid).children(recursive=True):
        try:
            if " ".join(p.cmdline()).startswith("ray::RolloutWorker"):
                out.append(p.pid)
        except psutil.Error:
            pass
    return out
