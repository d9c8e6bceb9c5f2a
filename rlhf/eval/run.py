"""Evaluate tasks on a rollout engine: batched generation (prefix caching shares few-shot heads), option
log-likelihoods from next-token log-probs (short options) or prompt log-probs (long ones), model-written code
in the sandbox; a progress bar per task."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlhf.eval.items import Task
from rlhf.eval.loglik import option_logprobs
from rlhf.eval.scoring import mean_stderr, pass_at_k
from rlhf.progress import progress_bar
from workers.sandbox import SandboxLimits
from workers.sandbox.verdict import run_checks

CHUNK = 64  # items per engine call: the bar moves between calls; the engine batches within one


@dataclass
class EvalOptions:
    n: int = 1  # samples per item (generate and code tasks)
    temperature: float = 0.0
    max_tokens: int = 256
    seed: int = 0
    k: list[int] = field(default_factory=list)  # pass@k reported (default: 1 and n)
    sandbox_workers: int = 2
    sandbox: SandboxLimits = field(default_factory=lambda: SandboxLimits(wall_s=10.0, cpu_s=5.0))
    progress: bool = True  # a bar per task on stderr (off during training: the training bar is there)

    def ks(self, n: int | None = None) -> list[int]:
        """The k of pass@k reported for `n` samples per item (default: opts.n)."""
        n = self.n if n is None else n
        return sorted({k for k in (self.k or [1, n]) if k <= n})

    def recorded(self) -> dict[str, Any]:
        return {"n": self.n, "temperature": self.temperature, "max_tokens": self.max_tokens, "seed": self.seed,
                "k": self.ks()}


def evaluate(engine: Any, tokenizer: Any, task: Task, opts: EvalOptions) -> dict[str, Any]:
    """One task's result: {metric, value, stderr, n, config, metrics (all of them), samples}."""
    if task.kind == "harness":
        from rlhf.eval.harness import evaluate_harness

        return evaluate_harness(engine, tokenizer, task, opts)
    bar = progress_bar(len(task.items), task.short, unit="item", enabled=opts.progress, leave=False)
    try:
        if task.kind == "choice":
            metrics, samples = _choice(engine, tokenizer, task, bar)
        else:
            responses = generate(engine, task, opts, bar)
            if task.kind == "code":
                metrics, samples = _code(task, responses, opts, bar)
            else:
                metrics, samples = _scored(task, responses, opts)
    finally:
        bar.close()
    main = next(iter(metrics))
    config = {"kind": task.kind, **task.config, **({} if task.kind == "choice" else opts.recorded())}
    return {"metric": main, "value": metrics[main]["value"], "stderr": metrics[main]["stderr"],
            "n": len(task.items), "config": config, "metrics": metrics, "samples": samples}


def metric_names(tasks: list[Task]) -> list[str]:
    """The name of each task in metric keys: its short name, or its full one where two short names clash."""
    shorts = [t.short for t in tasks]
    return [t.short if shorts.count(t.short) == 1 else t.name for t in tasks]


def eval_metrics(engine: Any, tokenizer: Any, tasks: list[Task], opts: EvalOptions) -> dict[str, float]:
    """Every task's scalar metrics as `eval/<task>/<metric>` (for the training loop's metric sinks), the task
    by its short name (`mc:abstract_algebra_test`, not the file's path)."""
    out = {}
    for task, name in zip(tasks, metric_names(tasks)):
        for metric, m in evaluate(engine, tokenizer, task, opts)["metrics"].items():
            if isinstance(m["value"], (int, float)):
                out[f"eval/{name}/{metric}"] = float(m["value"])
    return out


def generate(engine: Any, task: Task, opts: EvalOptions, bar: Any = None) -> list[list[str]]:
    """`opts.n` responses per item, in item order."""
    from workers.batch import Batch
    from workers.rollout import SamplingConfig

    sampling = SamplingConfig(n=opts.n, temperature=opts.temperature, max_tokens=opts.max_tokens, seed=opts.seed,
                              stop=list(task.stop)).validate()
    texts: list[str] = []
    for start in range(0, len(task.items), CHUNK):
        chunk = task.items[start:start + CHUNK]
        out = engine.generate(Batch(meta={"prompt": [it.prompt for it in chunk]}), sampling)
        texts += list(out["response_text"])
        if bar is not None and task.kind != "code":  # a code task's bar counts its sandbox runs
            bar.update(len(chunk))
    return [texts[i * opts.n:(i + 1) * opts.n] for i in range(len(task.items))]


def _pass_at(counts: list[int], n: int, ks: list[int]) -> dict[str, dict[str, float]]:
    return {f"pass@{k}": dict(zip(("value", "stderr"), mean_stderr([pass_at_k(n, c, k) for c in counts])))
            for k in ks}


def _scored(task: Task, responses: list[list[str]], opts: EvalOptions) -> tuple[dict, list]:
    assert task.score is not None
    per_item = [[task.score(it, r) for r in rs] for it, rs in zip(task.items, responses)]
    acc, se = mean_stderr([sum(s) / len(s) for s in per_item])
    metrics = {"accuracy": {"value": acc, "stderr": se}}
    if opts.n > 1:
        metrics.update(_pass_at([int(sum(s)) for s in per_item], opts.n, opts.ks()))
    samples = [{"prompt": it.prompt, "gold": it.gold, "responses": rs, "scores": s}
               for it, rs, s in zip(task.items, responses, per_item)]
    return metrics, samples


def _code(task: Task, responses: list[list[str]], opts: EvalOptions, bar: Any = None) -> tuple[dict, list]:
    assert task.program is not None
    n = len(responses[0]) if responses else opts.n
    checks = [task.program(it, r) for it, rs in zip(task.items, responses) for r in rs]
    if bar is not None:
        bar.reset(total=len(checks))
        bar.unit = "run"
    results = run_checks(checks, opts.sandbox, workers=opts.sandbox_workers,
                         on_done=None if bar is None else lambda _: bar.update(1))
    ok = [all(r.passed) for r in results]
    passed = [ok[i * n:(i + 1) * n] for i in range(len(task.items))]
    metrics: dict[str, Any] = _pass_at([sum(p) for p in passed], n, opts.ks(n))
    statuses: dict[str, int] = {}
    for r in results:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    metrics["sandbox"] = {"value": statuses, "stderr": 0.0}
    samples = [{"task_id": it.meta.get("task_id"), "responses": rs, "passed": p}
               for it, rs, p in zip(task.items, responses, passed)]
    return metrics, samples


def _choice(engine: Any, tokenizer: Any, task: Task, bar: Any = None) -> tuple[dict, list]:
    lps: list[list[float]] = []
    for start in range(0, len(task.items), CHUNK):
        chunk = task.items[start:start + CHUNK]
        lps += option_logprobs(engine, tokenizer, chunk)
        if bar is not None:
            bar.update(len(chunk))
    hits = [float(max(range(len(lp)), key=lp.__getitem__) == it.gold) for it, lp in zip(task.items, lps)]
    hits_norm = [float(max(range(len(lp)), key=lambda j: lp[j] / max(len(it.choices[j]), 1)) == it.gold)
                 for it, lp in zip(task.items, lps)]
    metrics = {"acc": dict(zip(("value", "stderr"), mean_stderr(hits))),
               "acc_norm": dict(zip(("value", "stderr"), mean_stderr(hits_norm)))}
    samples = [{"prompt": it.prompt, "gold": it.gold, "logprobs": lp} for it, lp in zip(task.items, lps)]
    return metrics, samples
