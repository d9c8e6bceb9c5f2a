"""The one-step-off pipeline against the synchronous loop: GRPO on the arithmetic example, same steps.

Both runs start from the same cached SFT warm start of arith-qwen2 and take the example's config
(configs/grpo_tiny.yaml) with `--steps` steps. `sync` as shipped (generation and training alternate, each with
2 threads); `one_step_off` generates the next step's samples while this step trains, with
`algorithm.off_policy_correction=tis`; generation gets one thread and the trainer two (measured: 1 + 1 threads
gave a 0.73 step-time ratio, the trainer's passes being the longer side). Every mode takes the old
log-probs from its one optimizer step's forward (`algorithm.old_logprobs=in_update`, which the correction
uses; no recompute pass). Reported: the median step time after `--skip` warm-up
steps, the ratio one_step_off / sync (`RATIO step_time_one_step_off_vs_sync`, target <= 0.7) and the greedy
held-out accuracy at the last step of each (target: within 5 points of sync). `async` is the bounded-staleness
buffer with partial rollouts of 2 tokens a round (`rollout.max_staleness=1`), with the same threads and
correction as `one_step_off` (`RATIO step_time_async_vs_sync`).

Usage: python bench/async.py [--steps N] [--skip K]. Runs go under runs/bench/async/.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _common as C

CONFIG = "configs/grpo_tiny.yaml"
OUT = C.WORK / "async"
MODES = {
    "sync": ["rollout.mode=sync"],
    "one_step_off": ["rollout.mode=one_step_off", "algorithm.off_policy_correction=tis", "rollout.num_threads=1",
                     "policy.resources.num_threads=2"],
    "async": ["rollout.mode=async", "rollout.partial_tokens=2", "rollout.max_staleness=1",
              "algorithm.off_policy_correction=tis", "rollout.num_threads=1", "policy.resources.num_threads=2"],
}


def overrides(model: Path, data: dict[str, Path], steps: int) -> list[str]:
    return [
        f"model.path={model}", "model.preset=null", "model.warm_start_steps=0", "data.task=null",
        f"data.train_file={data['rl_train']}", f"data.val_file={data['rl_val']}", "data.val_size=0",
        "data.messages_key=messages", "algorithm.old_logprobs=in_update", f"trainer.total_steps={steps}",
        f"trainer.val_every={steps}", "trainer.save_every=0", "trainer.export_hf=false",
        "trainer.progress_bar=false", "trainer.tensorboard=false",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="GRPO steps per mode")
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    args = p.parse_args(argv)
    print(C.machine_line(), flush=True)
    data = C.arith_data(seed=0, val_size=200)
    model = C.model_dir("arith-qwen2", warm_steps=250, data=data)
    t_all = time.perf_counter()
    results = {}
    for mode, extra in MODES.items():
        load = C.machine()["load1"]
        run = C.run_ours(CONFIG, overrides(model, data, args.steps) + extra, OUT / mode, timeout_s=3600)
        rows = [r for r in run["rows"] if r.get("step", 0) >= 1]
        vals = [r for r in run["rows"] if "val/accuracy" in r]
        phases = {k: C.median(r.get(k, 0.0) for r in rows[args.skip:] or rows)
                  for k in sorted({k for r in rows for k in r if k.startswith("time/")})}
        results[mode] = dict(step_s=C.median(C.step_times(run["rows"], skip=args.skip)), load=load,
                             first=vals[0]["val/accuracy"], last=vals[-1]["val/accuracy"], phases=phases,
                             lag=max((r.get("rollout/version_lag_max", 0.0) for r in rows), default=0.0))
        print(f"  {mode}: median step {results[mode]['step_s']:.3f} s, accuracy {results[mode]['first']:.1%} -> "
              f"{results[mode]['last']:.1%}", flush=True)
    print(C.table(["mode", "median step s", "accuracy first -> last", "max version lag", "phases (median s)",
                   "load"],
                  [[m, r["step_s"], f"{r['first']:.1%} -> {r['last']:.1%}", r["lag"],
                    ", ".join(f"{k[5:]} {v:.3f}" for k, v in r["phases"].items()), r["load"]]
                   for m, r in results.items()]))
    print(f"total {time.perf_counter() - t_all:.0f} s; command: python bench/async.py {' '.join(argv or sys.argv[1:])}")
    for mode in ("one_step_off", "async"):
        print(C.ratio_line(f"step_time_{mode}_vs_sync", results[mode]["step_s"] / results["sync"]["step_s"]))
        gap = (results[mode]["last"] - results["sync"]["last"]) * 100
        print(f"accuracy {mode} - sync at step {args.steps}: {gap:+.1f} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
