"""`make examples`: every example config's full learning run, checked and written to bench/RESULTS.md.

Each config in `configs/` is trained as shipped (`rlhf train CONFIG`, no checkpoints) and its curve is
checked against what the example promises: the RL and DPO examples raise greedy held-out accuracy, the LM
examples lower the held-out loss. The criteria count steps and evaluations, never wall time, so a slower machine
passes too; wall time is reported beside them. The table between the markers in bench/RESULTS.md is
replaced by this run's rows; the exit code is 1 if any example missed its criterion.

    python examples/learning.py                   # all examples (over 40 min on 2 cores: the sum of the table's wall times)
    python examples/learning.py --only grpo_tiny  # one of them
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- make examples: begin -->", "<!-- make examples: end -->"

Curve = list[tuple[int, float]]


@dataclass(frozen=True)
class Example:
    name: str
    metric: str  # the evaluated curve, read from metrics.jsonl
    check: Callable[..., str | None]  # None when the curve meets the promise (and the baseline's), else why not
    promise: str
    extras: tuple[str, ...] = ()  # metrics shown beside the curve, from the last evaluation that logged them
    # overrides of the shipped config, "{out}" standing for the examples' output folder (an example that reads
    # an earlier one's result, e.g. its exported reward model, is listed after it)
    overrides: tuple[str, ...] = ()
    # an earlier example whose curve of the same metric the promise compares with: `check(curve, baseline)`
    baseline: str | None = None


def _points(curve: Curve) -> tuple[float, float, float]:
    """(first, best after the first, mean of the last two) of an accuracy curve."""
    return curve[0][1], max(v for _, v in curve[1:]), sum(v for _, v in curve[-2:]) / 2


def grpo_learned(curve: Curve) -> str | None:
    """+25 points at the best evaluation and +20 on the mean of the last two (one evaluation of 200 prompts
    moves by ~3 points between neighbours, and other CPUs round differently)."""
    start, best, end = _points(curve)
    if best - start < 0.25 or end - start < 0.20:
        return f"accuracy {start:.1%} -> best {best:.1%}, last two {end:.1%} (want +25 / +20 points)"
    return None


def ppo_learned(curve: Curve) -> str | None:
    start, _, end = _points(curve)
    return None if end - start >= 0.05 else f"accuracy {start:.1%} -> last two {end:.1%} (want +5 points)"


def best_up_20(curve: Curve) -> str | None:
    """+20 points at the best evaluation (the issues' promise for the calculator and the MoE examples)."""
    start, best, _ = _points(curve)
    return None if best - start >= 0.20 else f"accuracy {start:.1%} -> best {best:.1%} (want +20 points)"


def lora_learned(curve: Curve) -> str | None:
    """+15 points over the warm start (the step-0 evaluation) on the mean of the last two evaluations (the
    issue's promise for GRPO with LoRA; the config's steps fit in 15 minutes on 2 cores)."""
    start, _, end = _points(curve)
    return None if end - start >= 0.15 else f"accuracy {start:.1%} -> last two {end:.1%} (want +15 points)"


def distilled(curve: Curve, grpo: Curve) -> str | None:
    """On-policy distillation from the same warm start as GRPO: +15 points at the best evaluation, reached in
    fewer optimizer steps than GRPO needs to reach that accuracy (or GRPO never does)."""
    start, best, _ = _points(curve)
    at = next(step for step, v in curve if v == best)
    grpo_at = next((step for step, v in grpo if v >= best), None)
    if best - start < 0.15:
        return f"accuracy {start:.1%} -> best {best:.1%} (want +15 points)"
    if grpo_at is not None and grpo_at <= at:
        return f"best {best:.1%} at step {at}; GRPO from the same start got there by step {grpo_at} (want fewer steps)"
    return None


def ran(curve: Curve) -> None:
    """The smoke example's promise: it trains and evaluates (learning is not promised)."""
    return None


def dpo_learned(curve: Curve) -> str | None:
    """+15 points of greedy held-out accuracy over the warm start (the step-0 evaluation), on the mean of the
    last two evaluations."""
    start, _, end = _points(curve)
    return None if end - start >= 0.15 else f"accuracy {start:.1%} -> last two {end:.1%} (want +15 points)"


def kto_learned(curve: Curve) -> str | None:
    """+10 points of greedy held-out accuracy over the warm start (the step-0 evaluation), on the mean of the
    last two evaluations (the issue's promise for KTO on pairs split into unpaired examples)."""
    start, _, end = _points(curve)
    return None if end - start >= 0.10 else f"accuracy {start:.1%} -> last two {end:.1%} (want +10 points)"


def deepseek_learned(curve: Curve) -> str | None:
    """+15 points of greedy held-out accuracy over the warm start (the step-0 evaluation), at the best
    evaluation and on the mean of the last two (the DeepSeek example's promise)."""
    start, best, end = _points(curve)
    if best - start < 0.15 or end - start < 0.15:
        return f"accuracy {start:.1%} -> best {best:.1%}, last two {end:.1%} (want +15 points)"
    return None


def rm_learned(curve: Curve) -> str | None:
    """A reward model that prefers the correct sum on at least 75% of the held-out pairs (chance: 50%) at the
    best evaluation and 70% on the mean of the last two."""
    _, best, end = _points(curve)
    if best < 0.75 or end < 0.70:
        return f"held-out pair accuracy best {best:.1%}, last two {end:.1%} (want 75% / 70%)"
    return None


def reward_rose(curve: Curve) -> str | None:
    """The learned reward of the greedy held-out answers rises: the mean of the last two evaluations above the
    first by at least 0.5 (a logit of the reward model: 0.5 moves a pair's preference odds by 1.65x)."""
    start, _, end = _points(curve)
    return None if end - start >= 0.5 else f"reward {start:.3f} -> last two {end:.3f} (want +0.5)"


def loss_fell(curve: Curve) -> str | None:
    start, end = curve[0][1], curve[-1][1]
    return None if end < 0.8 * start else f"held-out loss {start:.3f} -> {end:.3f} (want below 80% of the first)"


EXAMPLES = [
    Example("grpo_tiny", "val/accuracy", grpo_learned, "greedy accuracy +25 points (best), +20 (last two)"),
    Example("distill_tiny", "val/accuracy", distilled,
            "greedy accuracy +15 points (best), on-policy distillation from grpo_tiny's export, reaching its best in "
            "fewer steps than grpo_tiny from the same warm start", ("distill/teacher_kl", "distill/top1_agreement"),
            ("teacher.model_path={out}/grpo_tiny/hf",), baseline="grpo_tiny"),
    Example("ppo_tiny", "val/accuracy", ppo_learned, "greedy accuracy +5 points (last two)"),
    Example("grpo_tiny_moe", "val/accuracy", best_up_20,
            "greedy accuracy +20 points (best), MoE at EP=2 with routing replay, Megatron warm start",
            ("mismatch/routing_disagreement", "mismatch/logprob_abs_diff_max", "moe/load_imbalance")),
    Example("grpo_tiny_deepseek", "val/accuracy", deepseek_learned,
            "greedy accuracy +15 points (best and last two), DeepSeek-V3-style MLA + MoE, within 15 min"),
    Example("grpo_tiny_lora", "val/accuracy", lora_learned,
            "greedy accuracy +15 points (last two), LoRA adapters only, within 15 min on 2 cores"),
    Example("grpo_tiny_tools", "val/accuracy", best_up_20, "greedy accuracy +20 points (best), calculator tool",
            ("val/agent/tool_calls_per_trajectory", "val/agent/tool_errors", "agent/tool_calls_per_trajectory",
             "agent/tool_errors")),
    Example("grpo_tiny_openai_agent", "val/accuracy", best_up_20,
            "greedy accuracy +20 points (best), an openai-client agent with its own calculator loop",
            ("val/agent/calls_per_session", "agent/calls_per_session", "agent/session_errors",
             "agent/session_timeouts")),
    Example("grpo_tiny_code", "val/accuracy", ran, "runs: sandboxed unit-test reward, pass rate reported",
            ("val/reward_mean", "reward_mean")),
    Example("grpo_shapes_vl", "val/accuracy", best_up_20,
            "greedy accuracy +20 points (best) over the SFT warm start, Qwen2-VL on image prompts (shapes task)",
            ("mismatch/logprob_abs_diff_max",)),
    Example("dpo_tiny", "val/greedy_accuracy", dpo_learned, "greedy accuracy +15 points (last two)"),
    Example("kto_tiny", "val/greedy_accuracy", kto_learned,
            "greedy accuracy +10 points (last two), KTO on the pairs split into unpaired examples",
            ("val/kto/kl_baseline", "kto/kl_baseline")),
    Example("online_dpo_tiny", "val/accuracy", dpo_learned,
            "greedy accuracy +15 points (last two), DPO on the best-vs-worst of the policy's own samples",
            ("online_dpo/kept_fraction", "rewards/accuracy")),
    Example("rm_tiny", "val/accuracy", rm_learned, "held-out pair accuracy 75% (best), 70% (last two)",
            ("val/margin",)),
    Example("ppo_tiny_rm", "val/reward_mean", reward_rose, "learned reward of greedy answers +0.5 (last two)",
            ("val/accuracy",), ("reward.model_path={out}/rm_tiny/hf",)),
    Example("sft_tiny", "val/loss", loss_fell, "held-out loss below 80% of the first evaluation"),
    Example("pretrain_tiny", "val/loss", loss_fell, "held-out loss below 80% of the first evaluation"),
]


def train(example: Example, out: Path) -> dict:
    """Run the example's config as shipped (plus its overrides) into `out`; its curve, wall time and step times."""
    cmd = [sys.executable, "-m", "rlhf", "train", f"configs/{example.name}.yaml", "trainer.progress_bar=false",
           "trainer.save_every=0", f"trainer.output_dir={out}",
           *(o.format(out=out.parent) for o in example.overrides)]
    shutil.rmtree(out, ignore_errors=True)  # this script's own output: a rerun starts it afresh
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with (out.parent / f"{example.name}.log").open("w") as log:
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1")).returncode
    wall = time.perf_counter() - t0
    rows = read_rows(out) if rc == 0 else []
    curve = [(r["step"], float(r[example.metric])) for r in rows if example.metric in r]
    base = [(r["step"], float(r[example.metric])) for r in read_rows(out.parent / example.baseline)
            if example.metric in r] if example.baseline else []
    steps = [r["step_time_s"] for r in rows if "step_time_s" in r]
    extras = {k: next((float(r[k]) for r in reversed(rows) if k in r), float("nan")) for k in example.extras}
    failure = (f"`rlhf train` exited {rc} (log: {out.parent / (example.name + '.log')})" if rc
               else "fewer than two evaluations" if len(curve) < 2
               else f"no curve of {example.baseline} to compare with (run it first)" if example.baseline and not base
               else example.check(curve, base) if example.baseline else example.check(curve))
    return {"curve": curve, "baseline": base, "wall_s": wall, "steps": max((r["step"] for r in rows), default=0),
            "median_step_s": statistics.median(steps) if steps else float("nan"), "failure": failure,
            "extras": extras}


def read_rows(run_dir: Path) -> list[dict]:
    """A run's metrics.jsonl rows (none when it has not run)."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def head_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip() or "?"


def run_stamp(commit: str) -> str:
    """The commit the example started at, the time it finished, the cores and the load then."""
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"{commit}, {stamp}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"


def row(example: Example, res: dict, stamp: str) -> str:
    curve = res["curve"]
    pct = example.metric.endswith("accuracy")
    fmt = (lambda v: f"{v:.1%}") if pct else (lambda v: f"{v:.3f}")
    shown = f"{fmt(curve[0][1])} -> {fmt(curve[-1][1])}" if curve else "-"
    if pct and len(curve) > 1:
        shown += f" (best {fmt(max(v for _, v in curve[1:]))})"
    if res.get("baseline"):
        base = res["baseline"]
        shown += f"; {example.baseline}: " + ", ".join(f"{fmt(v)} @{step}" for step, v in base)
        shown += "; this run: " + ", ".join(f"{fmt(v)} @{step}" for step, v in curve)
    if res.get("extras"):
        shown += "; last " + ", ".join(f"{k} {v:.3g}" for k, v in res["extras"].items())
    verdict = "**fail**: " + res["failure"] if res["failure"] else "pass"
    return (f"| `{example.name}` | {example.metric} {shown} | {res['steps']} | {res['median_step_s']:.3f} s "
            f"| {res['wall_s'] / 60:.1f} min | {example.promise} | {verdict} | {stamp} |")


def write_results(rows: list[str], results: Path) -> None:
    """Replace the table between the markers in `results` (appended with a heading if absent)."""
    body = "\n".join([
        BEGIN,
        "Written by `make examples` (examples/learning.py): each config as shipped, wall time for the whole",
        "`rlhf train` command; the run column gives the commit it started at, the time it finished, the cores and the",
        "1-minute load average then.",
        "",
        "| example | curve (first -> last evaluation) | steps | median step | wall time | promise | result | run |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        END,
    ])
    text = results.read_text() if results.exists() else "# Bench results\n"
    names = {r.split("`")[1] for r in rows}
    if BEGIN in text and END in text:  # keep the rows of examples not run this time
        kept = [ln for ln in text.split(BEGIN, 1)[1].split(END, 1)[0].splitlines()
                if ln.startswith("| `") and ln.split("`")[1] not in names]
        body = body.replace("\n" + END, "\n" + "\n".join(kept) + "\n" + END) if kept else body
        head, rest = text.split(BEGIN, 1)
        text = head + body + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n## The learning examples (`make examples`)\n\n" + body + "\n"
    results.write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", choices=[e.name for e in EXAMPLES], help="run only these examples")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "examples", help="run folders go here")
    p.add_argument("--results", type=Path, default=REPO / "bench" / "RESULTS.md", help="the file to update")
    args = p.parse_args(argv)
    chosen = [e for e in EXAMPLES if not args.only or e.name in args.only]
    rows, failed = [], []
    for example in chosen:
        print(f"== {example.name}: {example.promise}", flush=True)
        commit = head_commit()
        res = train(example, args.out / example.name)
        rows.append(row(example, res, run_stamp(commit)))
        print(rows[-1], flush=True)
        if res["failure"]:
            failed.append(example.name)
    write_results(rows, args.results)
    print(f"{len(chosen) - len(failed)} passed, {len(failed)} failed" + (f": {' '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
