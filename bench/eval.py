"""Multiple-choice evaluation speed: `rlhf eval`'s option log-likelihoods on the vLLM rollout engine against
lm-evaluation-harness's own `hf` model backend (HFLM.loglikelihood) on the same model and the same requests.

Items: MMLU-layout questions (a few-shot head shared by every item, four options each), built locally. Both
sides get the same torch threads; ours uses prefix caching (the shared head and each question are computed
once for its four options), which is the point of running the eval on the engine. The prefix cache is reset
before each of our rounds so no round reuses another's work. Rounds alternate (ours, theirs); the RATIO is the
median over rounds of our items/s over theirs. Also prints the largest difference of the log-likelihoods.
Prints `RATIO eval_mc_vs_lm_eval <ours / lm-eval items per second>` (target >= 2).
Usage: python bench/eval.py [--preset small-qwen2] [--items 200] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import CACHE, machine_line, median, model_dir, ratio_line, table


def write_items(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        opts = [a + b, a + b + 1, a + b - 10, a * 2]
        rng.shuffle(opts)
        rows.append(f"What is {a}+{b}?,{opts[0]},{opts[1]},{opts[2]},{opts[3]},{'ABCD'[opts.index(a + b)]}")
    path.write_text("\n".join(rows) + "\n")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-qwen2")
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--fewshot", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    from rlhf.eval.loglik import option_logprobs
    from rlhf.eval.tasks import load_task
    from workers.rollout import EngineConfig, RolloutGroup

    torch.set_num_threads(args.threads)
    model = str(model_dir(args.preset))
    CACHE.mkdir(parents=True, exist_ok=True)
    data = write_items(CACHE / "arith_mc_test.csv", args.items + args.fewshot)
    task = load_task(f"mc:{data}", num_fewshot=args.fewshot)
    tok = AutoTokenizer.from_pretrained(model)
    engine = RolloutGroup(EngineConfig(model_path=model, kv_cache_gb=1.0, num_threads=args.threads), in_process=True)
    lm = HFLM(pretrained=model, device="cpu", batch_size=32, dtype="float32")
    requests = [Instance("loglikelihood", doc={}, arguments=(it.prompt, c), idx=j)
                for it in task.items for j, c in enumerate(it.choices)]
    ours_rate, theirs_rate, ratios, diff = [], [], [], 0.0
    try:
        option_logprobs(engine, tok, task.items[:4])  # warm-up of both sides
        lm.loglikelihood(requests[:16], disable_tqdm=True)
        for _ in range(args.rounds):
            engine.engines[0].reset_prefix_cache()
            t = time.perf_counter()
            ours = option_logprobs(engine, tok, task.items)
            ours_rate.append(len(task.items) / (time.perf_counter() - t))
            t = time.perf_counter()
            theirs = lm.loglikelihood(requests, disable_tqdm=True)
            theirs_rate.append(len(task.items) / (time.perf_counter() - t))
            ratios.append(ours_rate[-1] / theirs_rate[-1])
            flat = [x for lp in ours for x in lp]
            diff = max(diff, max(abs(a - b[0]) for a, b in zip(flat, theirs)))
    finally:
        engine.shutdown()
    print(machine_line())
    print(table(["side", "items/s (median)", "rounds"],
                [["rlhf eval (vLLM, prefix cache)", median(ours_rate), len(ours_rate)],
                 ["lm-eval hf backend", median(theirs_rate), len(theirs_rate)]]))
    print(f"largest log-likelihood difference: {diff:.2e} over {len(requests)} options")
    print(ratio_line("eval_mc_vs_lm_eval", median(ratios)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
