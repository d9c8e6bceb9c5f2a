"""The staged pipeline on the tiny arithmetic task, in one process on one embedded Ray:

  1. init a tiny Qwen2 (~0.8M parameters) and generate the task data;
  2. SFT on the Megatron backend (assistant-only loss, packed rows);
  3. GRPO with the exact-match reward (vLLM rollout, Megatron policy);
  4. export the policy to HF safetensors;
  5. `rlhf generate` a few answers from the export, and `rlhf eval` on the held-out questions;
  and print the greedy held-out accuracy after each stage. `make run` runs it.

    python examples/pipeline_tiny/run.py --out runs/pipeline_tiny [--sft-steps 400 --grpo-steps 1500]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `rlhf eval` (vLLM) and the pipeline's own check (transformers) decode the same held-out questions greedily;
# float rounding may flip a near-tie, so they may differ by a few answers, not more
MAX_EVAL_GAP = 0.05


def held_out(data_dir: Path) -> list[tuple[list, str]]:
    rows = [json.loads(x) for x in (data_dir / "rl_val.jsonl").read_text().splitlines()]
    return [(r["messages"], r["answer"]) for r in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/pipeline_tiny")
    ap.add_argument("--sft-steps", type=int, default=400)
    ap.add_argument("--grpo-steps", type=int, default=1500)
    ap.add_argument("--fresh", action="store_true", help="delete --out first")
    ap.add_argument("--sft-overrides", nargs="*", default=[], help="extra KEY=VALUE overrides of configs/sft_tiny.yaml")
    ap.add_argument("--grpo-overrides", nargs="*", default=[], help="extra KEY=VALUE overrides of configs/grpo_tiny.yaml")
    args = ap.parse_args()

    import ray

    from rlhf.commands.train import quiet_libraries
    from rlhf.config import load_config
    from rlhf.data.arithmetic import write_arithmetic_data
    from rlhf.driver.infra.ray_env import init_ray
    from rlhf.driver.rl.runner import run_rl
    from rlhf.driver.stages.lm import run_lm
    from rlhf.driver.warmstart.hf_sft import greedy_accuracy
    from rlhf.driver.warmstart.prepare import prepare_inputs
    from rlhf.tiny_models import create_tiny_model

    quiet_libraries()  # the console shows the stages and their progress bars; library chatter stays off it
    out = Path(args.out)
    if args.fresh:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    for stage in ("sft", "grpo"):  # this script's own stage outputs: a rerun starts them afresh
        shutil.rmtree(out / stage, ignore_errors=True)
    t0 = time.time()
    accuracy: dict[str, float] = {}

    def say(text: str) -> None:
        print(f"[pipeline {time.time() - t0:4.0f}s] {text}", flush=True)

    def report(stage: str, model_dir: Path) -> None:
        accuracy[stage] = greedy_accuracy(model_dir, val)
        say(f"{stage:<5} greedy held-out accuracy: {accuracy[stage]:.1%}")

    # 1. init: a tiny model and the task data (200 held-out pairs)
    say(f"1/5 init: a tiny Qwen2 and the arithmetic task data in {out}")
    data_dir = out / "data"
    write_arithmetic_data(data_dir, seed=0, val_size=200)
    val = held_out(data_dir)
    init_dir = out / "init"
    if not (init_dir / "model.safetensors").is_file():
        create_tiny_model("arith-qwen2", init_dir)
    report("init", init_dir)

    init_ray(load_config("configs/sft_tiny.yaml").trainer)  # one embedded Ray for both training stages
    try:
        # 2. SFT on the Megatron backend
        say(f"2/5 sft: {args.sft_steps} steps on the Megatron backend; logs in {out / 'sft' / 'logs'}")
        sft = load_config("configs/sft_tiny.yaml", [
            f"model.path={init_dir}", f"data.train_file={data_dir / 'sft_train.jsonl'}",
            f"data.val_file={data_dir / 'sft_val.jsonl'}", f"trainer.total_steps={args.sft_steps}",
            f"trainer.output_dir={out / 'sft'}", "trainer.save_every=0",
            # 32 packed rows per step (about 190 conversations) on both cores. The task is learnt in a sudden
            # drop of the loss whose onset moves by ~50 steps with mere float rounding (micro-batch size):
            # 300 steps of linear decay gave 78.5% or 17.5%, cosine 37.5%; hence 400 steps (2026-11-30).
            "trainer.global_batch_size=32", "policy.micro_batch_size=16", "policy.resources.num_threads=2",
            *args.sft_overrides,
        ])
        run_lm(prepare_inputs(sft))
        report("sft", out / "sft" / "hf")

        # 3. GRPO from the SFT model; 4. its policy is exported to HF at the end
        say(f"3/5 grpo: {args.grpo_steps} steps (vLLM rollout, Megatron policy); logs in {out / 'grpo' / 'logs'}")
        grpo = load_config("configs/grpo_tiny.yaml", [
            f"model.path={out / 'sft' / 'hf'}", "model.warm_start_steps=0",
            f"data.train_file={data_dir / 'rl_train.jsonl'}", f"data.val_file={data_dir / 'rl_val.jsonl'}",
            "data.val_size=0", f"trainer.total_steps={args.grpo_steps}", f"trainer.output_dir={out / 'grpo'}",
            "trainer.save_every=0", "trainer.val_every=50", *args.grpo_overrides,
        ])
        run_rl(prepare_inputs(grpo))
    finally:
        ray.shutdown()
    say(f"4/5 export: the policy in HF format at {out / 'grpo' / 'hf'}")
    report("grpo", out / "grpo" / "hf")

    # 5. generate a few answers from the exported model on the rollout engine
    say("5/5 generate: `rlhf generate` on five held-out questions")
    prompts = out / "generate_prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": m}) + "\n" for m, _ in val[:5]))
    with (out / "generate.log").open("w") as log:  # the engine's start-up lines; shown if it fails
        done = subprocess.run([sys.executable, "-m", "rlhf", "generate", "--model", str(out / "grpo" / "hf"),
                               "--input", str(prompts), "--max-tokens", "8", "--output",
                               str(out / "generations.jsonl")], stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        sys.stderr.write((out / "generate.log").read_text()[-4000:])
        raise SystemExit(f"rlhf generate failed (exit {done.returncode}); its log: {out / 'generate.log'}")
    for (m, answer), row in zip(val, (json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines())):
        print(f"  {m[0]['content']:<16} -> {row['responses'][0]!r:<8} (expected {answer})")

    # the same held-out questions through `rlhf eval` (vLLM greedy): agrees with the HF greedy accuracy above
    with (out / "eval.log").open("w") as log:
        done = subprocess.run([sys.executable, "-m", "rlhf", "eval", "--model", str(out / "grpo" / "hf"),
                               "--tasks", f"prompts:{data_dir / 'rl_val.jsonl'}", "--max-tokens", "8",
                               "--output", str(out / "eval" / "results.json")], stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"rlhf eval failed (exit {done.returncode}); its log: {out / 'eval.log'}")
    evaluated = next(iter(json.loads((out / "eval" / "results.json").read_text())["tasks"].values()))["value"]
    say(f"rlhf eval on the held-out questions: {evaluated:.1%} (the pipeline's own greedy check: {accuracy['grpo']:.1%})")
    if abs(evaluated - accuracy["grpo"]) > MAX_EVAL_GAP:
        raise SystemExit(f"rlhf eval's accuracy {evaluated:.1%} and the pipeline's greedy accuracy {accuracy['grpo']:.1%} "
                         f"differ by more than {MAX_EVAL_GAP:.0%} (same model, questions and greedy decoding)")

    summary = {"accuracy": accuracy, "eval_accuracy": evaluated, "seconds": round(time.time() - t0, 1),
               "reward_curve": str(out / "grpo" / "report.png"), "summary": str(out / "grpo" / "summary.txt")}
    (out / "pipeline_summary.json").write_text(json.dumps(summary, indent=2))
    print(f"[pipeline] done in {summary['seconds']:.0f}s: " +
          " -> ".join(f"{k} {v:.1%}" for k, v in accuracy.items()) + f"; reward curve in {summary['reward_curve']}"
          f", metrics and logs under {out / 'sft'} and {out / 'grpo'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
