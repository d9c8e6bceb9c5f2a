"""`rlhf eval`: benchmark scores of an HF folder or a Megatron checkpoint on the rollout engine, and
`rlhf eval --compare` of several results files."""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate a model on benchmark tasks (or --compare results files)")
    p.add_argument("--model", help="HF model folder, a megatron checkpoint from `rlhf convert`, or a training "
                                   "checkpoint (<run>/checkpoints/<step>/policy; its run's config.yaml names the model)")
    p.add_argument("--tasks", help="comma-separated: humaneval, rg:<dataset>, mc:<file>, gsm8k:<file>, math:<file>, "
                                   "prompts:<file>, code:<file> (a file task may add @<examples file>), "
                                   "lm_eval:<task or yaml>[:<file>[@<examples file>]]")
    p.add_argument("--limit", type=int, help="at most this many items per task")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples per prompt: the first K rows of the examples "
                                                   "file, or of the data file (then not scored); default 0 (lm_eval: "
                                                   "the task's own)")
    p.add_argument("--n", type=int, default=1, help="samples per item (pass@k up to n)")
    p.add_argument("--k", help="comma-separated k of pass@k (each <= --n; default 1 and n)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="load a Megatron checkpoint that has no matching rlhf manifest (see README, Security)")
    p.add_argument("--output", default="results.json", help="results file (per task: metric, value, stderr, n)")
    p.add_argument("--compare", nargs="+", metavar="RESULTS", help="results files (or run folders holding "
                                                                   "results.json): a table and eval_compare.png")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rlhf.errors import UserError
    from rlhf.paths import staged_output_file

    if args.compare:
        return _compare(args.compare, Path(args.output).with_name("eval_compare.png"))
    if not args.model or not args.tasks:
        raise UserError("rlhf eval needs --model and --tasks (or --compare RESULTS ...)")
    if args.n < 1 or args.max_tokens < 1:
        raise UserError(f"--n={args.n} and --max-tokens={args.max_tokens} must be >= 1")
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit={args.limit} must be >= 1")
    ks = _ks(args.k, args.n)
    out = Path(args.output)
    _check_output(out)  # a folder that cannot be written fails now, not after the evaluation
    from rlhf.eval.tasks import load_task

    tasks = [load_task(t.strip(), args.limit, args.num_fewshot, args.seed) for t in args.tasks.split(",") if t.strip()]
    results = _evaluate(args, tasks, ks)
    with staged_output_file(out) as tmp:  # complete or absent: never a half-written results file
        tmp.write_text(json.dumps({"model": args.model, "tasks": results}, indent=2, default=str))
    print(markdown_table({args.model: results}))
    print(f"results in {out}")
    return 0


def _ks(arg: str | None, n: int) -> list[int]:
    from rlhf.errors import UserError

    if not arg:
        return []
    try:
        ks = [int(k) for k in arg.split(",") if k.strip()]
    except ValueError:
        raise UserError(f"--k={arg}: expected comma-separated integers such as 1,5,10") from None
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise UserError(f"--k={arg}: pass@{bad[0]} needs 1 <= k <= --n ({n} samples per item)")
    return ks


def _check_output(out: Path) -> None:
    """A folder that cannot take the results fails now: a read-only or full one names the file and the
    cause (workers.file_problems), anything else in the way (a file where the folder should be) says so."""
    from rlhf.errors import UserError
    from rlhf.paths import check_writable
    from workers.file_problems import file_errors

    try:
        with file_errors(out.parent, "create the folder"):
            out.parent.mkdir(parents=True, exist_ok=True)
        check_writable(out)
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        raise UserError(f"--output {out}: cannot write there ({where}{e.strerror or e})") from None


def _evaluate(args: argparse.Namespace, tasks: list, ks: list[int]) -> dict[str, Any]:
    from rlhf.commands.generate import hf_folder
    from rlhf.eval.run import EvalOptions, evaluate

    opts = EvalOptions(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed, k=ks)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rlhf-eval-") as tmp:
        model = hf_folder(args.model, tmp, args.trust_checkpoint)  # a bad folder fails before the engine's imports
        from transformers import AutoTokenizer

        from workers.rollout import EngineConfig, RolloutGroup

        tokenizer = AutoTokenizer.from_pretrained(model)
        engine = RolloutGroup(EngineConfig(model_path=model, dtype=args.dtype, kv_cache_gb=0.5), in_process=True)
        try:
            for i, task in enumerate(tasks, 1):
                t0 = time.time()
                note = f"; zero-shot: {task.config['zero_shot']}" if task.config.get("zero_shot") else ""
                print(f"[eval {i}/{len(tasks)}] {task.name}: {len(task.items)} items ({task.kind}{note})", flush=True)
                results[task.name] = evaluate(engine, tokenizer, task, opts)
                r = results[task.name]
                print(f"[eval {i}/{len(tasks)}] {task.name}: {r['metric']} {r['value']:.4f} +- {r['stderr']:.4f} "
                      f"({time.time() - t0:.0f}s)", flush=True)
        finally:
            engine.shutdown()
    return results


def markdown_table(runs: dict[str, dict[str, Any]]) -> str:
    """Tasks as rows, runs as columns: `value +- stderr` of each task's main metric."""
    names = list(runs)
    tasks = list(dict.fromkeys(t for r in runs.values() for t in r))
    lines = ["| task | metric | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for t in tasks:
        metric = next(r[t]["metric"] for r in runs.values() if t in r)
        cells = [f"{r[t]['value']:.4f} +- {r[t]['stderr']:.4f}" if t in r else "-" for r in runs.values()]
        lines.append(f"| {t} | {metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _compare(paths: list[str], figure: Path) -> int:
    from rlhf.errors import UserError
    from rlhf.paths import check_writable

    runs: dict[str, dict[str, Any]] = {}
    for p in paths:
        path = Path(p) / "results.json" if Path(p).is_dir() else Path(p)
        try:
            runs[str(p)] = json.loads(path.read_text())["tasks"]
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"--compare: {path} is not an `rlhf eval` results file ({e})") from None
    check_writable(figure)
    print(markdown_table(runs))
    _bar_chart(runs, figure)
    print(f"chart in {figure}")
    return 0


def legend_labels(paths: list[str]) -> list[str]:
    """The shortest trailing parts of each results path (without a final results.json) that tell them apart:
    `a/run1/results.json` and `b/run1/results.json` are `a/run1` and `b/run1`; the same path twice gets #2."""
    parts = [Path(p).parts[:-1] if Path(p).name == "results.json" else Path(p).parts for p in paths]
    parts = [ps or (str(p),) for ps, p in zip(parts, paths)]
    for depth in range(1, max(len(ps) for ps in parts) + 1):
        labels = ["/".join(ps[-depth:]) for ps in parts]
        if len(set(labels)) == len(labels):
            return labels
    labels = ["/".join(ps) for ps in parts]
    return [lab if labels[:i].count(lab) == 0 else f"{lab} #{labels[:i].count(lab) + 1}" for i, lab in enumerate(labels)]


def _bar_chart(runs: dict[str, dict[str, Any]], figure: Path) -> None:
    import matplotlib

    from rlhf.paths import staged_output_file

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(t for r in runs.values() for t in r))
    width = 0.8 / max(len(runs), 1)
    fig, ax = plt.subplots(figsize=(max(4, 1.5 * len(tasks)), 3))
    for j, (res, label) in enumerate(zip(runs.values(), legend_labels(list(runs)))):
        xs = [i + j * width for i, t in enumerate(tasks) if t in res]
        ax.bar(xs, [res[t]["value"] for t in tasks if t in res], width,
               yerr=[res[t]["stderr"] for t in tasks if t in res], label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tasks))], tasks)
    ax.legend(fontsize="small")
    fig.tight_layout()
    try:
        with staged_output_file(figure) as tmp:
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)
