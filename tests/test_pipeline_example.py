"""The staged pipeline (`make run`, examples/pipeline_tiny/run.py) end to end with a few steps per stage:
init -> Megatron SFT -> GRPO -> HF export -> `rlhf generate`, rerun over an existing run folder."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VLLM_INFO = re.compile(r"^.*\bINFO \d\d-\d\d \d\d:\d\d:\d\d \[.*$", re.M)  # vLLM's log format
TE_WARNING = "Transformer Engine and Apex are not installed"


@pytest.mark.slow
def test_pipeline_runs_every_stage(tmp_path):
    out = tmp_path / "pipeline"
    (out / "sft").mkdir(parents=True)
    (out / "sft" / "left_over.txt").write_text("from an earlier run")  # a rerun must not trip over it
    r = subprocess.run(
        [sys.executable, str(REPO / "examples/pipeline_tiny/run.py"), "--out", str(out), "--sft-steps", "3",
         "--grpo-steps", "2", "--grpo-overrides", "data.prompts_per_step=4", "rollout.n=4",
         "policy.micro_batch_size=16"],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    summary = json.loads((out / "pipeline_summary.json").read_text())
    assert list(summary["accuracy"]) == ["init", "sft", "grpo"]
    assert all(0.0 <= v <= 1.0 for v in summary["accuracy"].values())
    assert abs(summary["eval_accuracy"] - summary["accuracy"]["grpo"]) <= 0.05  # rlhf eval agrees with HF greedy
    assert (out / "grpo" / "hf" / "model.safetensors").is_file() and (out / "grpo" / "report.png").is_file()
    rows = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and all(row["responses"] for row in rows)
    assert "greedy held-out accuracy" in r.stdout and not (out / "sft" / "left_over.txt").exists()
    # the console shows each stage and its progress bar, not the engines' start-up lines
    assert all(f"{i}/5 " in r.stdout for i in range(1, 6)) and "grpo: 100%" in r.stderr
    assert "Loading safetensors checkpoint shards" not in r.stderr
    # library chatter (vLLM's INFO lines, megatron-core's Transformer Engine warning) stays off the console
    console = r.stdout + r.stderr
    assert not VLLM_INFO.search(console), VLLM_INFO.search(console).group(0)
    assert TE_WARNING not in console
