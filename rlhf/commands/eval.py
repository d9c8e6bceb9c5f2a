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
    p.add_argument("--model", help="HF model folder, or a megatron checkpoint from `rlhf convert` / training")
    p.add_argument("--tasks", help="comma-separated: humaneval, rg:<dataset>, mc:<file>, gsm8k:<file>, "
                                   "math:<file>, prompts:<file>")
    p.add_argument("--limit", type=int, help="at most this many items per task")
    p.add_argument("--num-fewshot", type=int, default=0, help="file tasks: the first K items become examples")
    p.add_argument("--n", type=int, default=1, help="samples per item (pass@k up to n)")
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
    from rlhf.paths import check_writable, staged_output_file

    if args.compare:
        return _compare(args.compare, Path(args.output).with_name("eval_compare.png"))
    if not args.model or not args.tasks:
        raise UserError("rlhf eval needs --model and --tasks (or --compare RESULTS ...)")
    if args.n < 1 or args.max_tokens < 1:
        raise UserError(f"--n={args.n} and --max-tokens={args.max_tokens} must be >= 1")
    from rlhf.eval.tasks import load_task

    tasks = [load_task(t.strip(), args.limit, args.num_fewshot, args.seed) for t in args.tasks.split(",") if t.strip()]
    out = Path(args.output)
    _make_folder(out.parent)
    check_writable(out)  # a read-only or missing folder fails now, not after the evaluation
    results = _evaluate(args, tasks)
    with staged_output_file(out) as tmp:  # complete or absent: never a half-written results file
        tmp.write_text(json.dumps({"model": args.model, "tasks": results}, indent=2, default=str))
    print(markdown_table({args.model: results}))
    print(f"results in {out}")
    return 0


def _make_folder(folder: Path) -> None:
    from workers.files import file_errors

    with file_errors(folder, "create the folder"):
        folder.mkdir(parents=True, exist_ok=True)


def _evaluate(args: argparse.Namespace, tasks: list) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from rlhf.commands.generate import hf_folder
    from rlhf.eval.run import EvalOptions, evaluate
    from workers.rollout import EngineConfig, RolloutGroup

    opts = EvalOptions(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rlhf-eval-") as tmp:
        model = hf_folder(args.model, tmp, args.trust_checkpoint)
        tokenizer = AutoTokenizer.from_pretrained(model)
        engine = RolloutGroup(EngineConfig(model_path=model, dtype=args.dtype, kv_cache_gb=0.5), in_process=True)
        try:
            for i, task in enumerate(tasks, 1):
                t0 = time.time()
                print(f"[eval {i}/{len(tasks)}] {task.name}: {len(task.items)} items ({task.kind})", flush=True)
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


def _bar_chart(runs: dict[str, dict[str, Any]], figure: Path) -> None:
    import matplotlib

    from rlhf.paths import staged_output_file

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(t for r in runs.values() for t in r))
    width = 0.8 / max(len(runs), 1)
    fig, ax = plt.subplots(figsize=(max(4, 1.5 * len(tasks)), 3))
    for j, (name, res) in enumerate(runs.items()):
        xs = [i + j * width for i, t in enumerate(tasks) if t in res]
        ax.bar(xs, [res[t]["value"] for t in tasks if t in res], width,
               yerr=[res[t]["stderr"] for t in tasks if t in res], label=Path(name).name or name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(tasks))], tasks)
    ax.legend(fontsize="small")
    fig.tight_layout()
    try:
        with staged_output_file(figure) as tmp:
            fig.savefig(tmp, format="png")
    finally:
        plt.close(fig)
