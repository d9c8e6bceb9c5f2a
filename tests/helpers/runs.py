"""A run folder's history (metrics.jsonl, checkpoints) and waiting on a running `rlhf train` for an event."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

HANG_S = 900.0  # bound of every wait: only a hang gets there


def metrics(run: Path) -> list[dict]:
    """Every row of the run's metrics.jsonl, as written (a resume's superseded rows included)."""
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def logged_steps(run: Path) -> list[int]:
    """The steps of the run's history (a resume supersedes the rows it logs again: read_metrics)."""
    from rlhf.driver.infra.metrics import read_metrics

    return [r["step"] for r in read_metrics(run)]


def latest_checkpoint(run: Path) -> int:
    latest = run / "checkpoints" / "latest"
    return int(latest.read_text().strip().split("-")[1]) if latest.is_file() else 0


def wait_for(what: str, check: Callable[[], Any], proc: subprocess.Popen, err_file: Path,
             timeout_s: float = HANG_S, exit_ok: bool = False) -> Any:
    """Poll `check()` until it returns something truthy; fail naming `what` if the run exits first
    (unless `exit_ok`) or nothing happens within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if proc.poll() is not None and not exit_ok:
            pytest.fail(f"the run exited (code {proc.returncode}) while the test waited for {what}:\n"
                        + err_file.read_text()[-3000:])
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout_s:g}s for {what}; the run's stderr ends:\n" + err_file.read_text()[-3000:])
        time.sleep(0.2)
    return value


LENGTH_REWARD = "def length(prompt, response, ground_truth):\n    return float(len(response))\n"


def run_rl_rows(cfg_path: str, overrides: list[str], tmp: Path, reward_module: str,
                step_fn: Callable | None = None) -> list[dict[str, Any]]:
    """`run_rl` in this process (the shared Ray must be up) on `cfg_path` with `overrides`, scored by the
    response's length in characters (a reward that varies on an untrained model) from a module named
    `reward_module` written to `tmp` (the reward workers get the driver's sys.path); the rows of steps >= 1.
    The run folder is tmp/run."""
    import importlib
    import sys

    from rlhf.api import load_config, prepare_inputs, run_rl

    (tmp / f"{reward_module}.py").write_text(LENGTH_REWARD)
    run = tmp / "run"
    cfg = load_config(cfg_path, [*overrides, f"reward.fn={reward_module}:length", "reward.num_workers=1",
                                 f"trainer.output_dir={run}"])
    sys.path.insert(0, str(tmp))
    importlib.invalidate_caches()
    t0 = time.perf_counter()
    try:
        run_rl(prepare_inputs(cfg), step_fn=step_fn)
    finally:
        sys.path.remove(str(tmp))
        sys.modules.pop(reward_module, None)
    rows = [row for row in metrics(run) if row["step"] > 0]
    print(f"{cfg_path} run: {time.perf_counter() - t0:.1f} s, of which {len(rows)} steps "
          f"{sum(row['step_time_s'] for row in rows):.1f} s")
    return rows
