"""Training-inference mismatch of an MoE policy with and without routing replay (R3).

Two short GRPO runs of `configs/grpo_tiny_moe.yaml` (arith-qwen2-moe at EP=2, the Megatron warm start) that
differ only in `policy.moe.routing_replay`, with the rollout engine in bfloat16 against the fp32 policy (in
fp32 both engines agree to ~1e-6 and no routing flips; bf16 makes the gap visible, as on GPUs where the
engine and the trainer use different kernels). Each step logs the mismatch of the engine's sampled-token
log-probs to the policy's recomputed ones (`mismatch/logprob_abs_diff_mean`, `_max`, `mismatch/kl`) and the
per-layer fraction of tokens whose top-k experts differ (`mismatch/routing_disagreement`, mean over the MoE
layers; `_max` the worst layer). The table gives each metric's mean over the steps of each run.
Figures: `RATIO moe_replay_kl_vs_none` (replay / none, target < 1), `RATIO moe_replay_abs_diff_mean_vs_none`,
and `DELTA moe_replay_routing_disagreement` (replay minus none; replay is 0 by construction).

    python bench/moe_replay.py [--steps 20] [--warm-steps 100] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import WORK, machine_line, run_ours, table

KEYS = ("mismatch/logprob_abs_diff_mean", "mismatch/logprob_abs_diff_max", "mismatch/kl",
        "mismatch/routing_disagreement", "mismatch/routing_disagreement_max")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warm-steps", type=int, default=100)
    ap.add_argument("--dtype", default="bfloat16", help="rollout.dtype (the policy stays fp32)")
    args = ap.parse_args()
    print(machine_line(), flush=True)
    means: dict[bool, dict[str, float]] = {}
    for replay in (False, True):
        out = WORK / "moe_replay" / ("replay" if replay else "none")
        res = run_ours("configs/grpo_tiny_moe.yaml", [
            f"policy.moe.routing_replay={str(replay).lower()}", f"rollout.dtype={args.dtype}",
            f"model.warm_start_steps={args.warm_steps}", f"trainer.total_steps={args.steps}", "trainer.val_every=0",
            "trainer.save_every=0", "trainer.progress_bar=false", "data.val_size=16"], out)
        rows = [r for r in res["rows"] if r.get("step", 0) >= 1 and KEYS[0] in r]
        means[replay] = {k: sum(r.get(k, 0.0) for r in rows) / max(len(rows), 1) for k in KEYS}
        means[replay]["steps"] = float(len(rows))
        means[replay]["step_time_s"] = sorted(r["step_time_s"] for r in rows)[len(rows) // 2] if rows else float("nan")
    print(table(["routing replay", "steps", "median step s", *KEYS],
                [[str(r), int(means[r]["steps"]), means[r]["step_time_s"], *(means[r][k] for k in KEYS)]
                 for r in (False, True)]))
    none, rep = means[False], means[True]
    print(f"RATIO moe_replay_kl_vs_none {rep['mismatch/kl'] / none['mismatch/kl']:.3f}")
    print(f"RATIO moe_replay_abs_diff_mean_vs_none "
          f"{rep['mismatch/logprob_abs_diff_mean'] / none['mismatch/logprob_abs_diff_mean']:.3f}")
    print(f"DELTA moe_replay_routing_disagreement "
          f"{rep['mismatch/routing_disagreement'] - none['mismatch/routing_disagreement']:.4f}")


if __name__ == "__main__":
    main()
