"""Evaluate tasks on a rollout engine: batched generation (prefix caching shares few-shot heads), option
log-likelihoods from the engine's prompt log-probs, model-written code in the sandbox."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rlhf.eval.code import passed as code_passed
from rlhf.eval.code import with_token
from rlhf.eval.scoring import mean_stderr, pass_at_k
from rlhf.eval.tasks import Item, Task
from workers.sandbox import SandboxLimits, run_many


@dataclass
class EvalOptions:
    n: int = 1  # samples per item (generate and code tasks)
    temperature: float = 0.0
    max_tokens: int = 256
    seed: int = 0
    sandbox_workers: int = 2
    sandbox: SandboxLimits = field(default_factory=lambda: SandboxLimits(wall_s=10.0, cpu_s=5.0))


def evaluate(engine: Any, tokenizer: Any, task: Task, opts: EvalOptions) -> dict[str, Any]:
    """One task's result: {metric, value, stderr, n, config, metrics (all of them), samples}."""
    if task.kind == "choice":
        metrics, samples = _choice(engine, tokenizer, task)
    else:
        responses = generate(engine, task, opts)
        if task.kind == "code":
            metrics, samples = _code(task, responses, opts)
        else:
            metrics, samples = _scored(task, responses)
    main = next(iter(metrics))
    config = {"kind": task.kind, **({} if task.kind == "choice" else
                                    {k: v for k, v in asdict(opts).items() if k != "sandbox"})}
    return {"metric": main, "value": metrics[main]["value"], "stderr": metrics[main]["stderr"],
            "n": len(task.items), "config": config, "metrics": metrics, "samples": samples}


def eval_metrics(engine: Any, tokenizer: Any, tasks: list[Task], opts: EvalOptions) -> dict[str, float]:
    """Every task's scalar metrics as `eval/<task>/<metric>` (for the training loop's metric sinks)."""
    out = {}
    for task in tasks:
        for name, m in evaluate(engine, tokenizer, task, opts)["metrics"].items():
            if isinstance(m["value"], (int, float)):
                out[f"eval/{task.name}/{name}"] = float(m["value"])
    return out


def generate(engine: Any, task: Task, opts: EvalOptions) -> list[list[str]]:
    """`opts.n` responses per item, in item order."""
    from workers.batch import Batch
    from workers.rollout import SamplingConfig

    sampling = SamplingConfig(n=opts.n, temperature=opts.temperature, max_tokens=opts.max_tokens, seed=opts.seed,
                              stop=list(task.stop)).validate()
    out = engine.generate(Batch(meta={"prompt": [it.prompt for it in task.items]}), sampling)
    texts = list(out["response_text"])
    return [texts[i * opts.n:(i + 1) * opts.n] for i in range(len(task.items))]


def _scored(task: Task, responses: list[list[str]]) -> tuple[dict, list]:
    assert task.score is not None
    per_item = [[task.score(it, r) for r in rs] for it, rs in zip(task.items, responses)]
    acc, se = mean_stderr([sum(s) / len(s) for s in per_item])
    metrics = {"accuracy": {"value": acc, "stderr": se}}
    n = len(responses[0])
    for k in sorted({1, n}) if n > 1 else []:
        vals = [pass_at_k(n, int(sum(s)), k) for s in per_item]
        metrics[f"pass@{k}"] = dict(zip(("value", "stderr"), mean_stderr(vals)))
    samples = [{"prompt": it.prompt, "gold": it.gold, "responses": rs, "scores": s}
               for it, rs, s in zip(task.items, responses, per_item)]
    return metrics, samples


def _code(task: Task, responses: list[list[str]], opts: EvalOptions) -> tuple[dict, list]:
    assert task.program is not None
    guarded = [with_token(task.program(it, r)) for it, rs in zip(task.items, responses) for r in rs]
    results = run_many([g[0] for g in guarded], opts.sandbox, workers=opts.sandbox_workers)
    ok = [code_passed(r, token) for r, (_, token) in zip(results, guarded)]
    n = opts.n
    passed = [ok[i * n:(i + 1) * n] for i in range(len(task.items))]
    metrics = {}
    for k in sorted({1, n}):
        vals = [pass_at_k(n, sum(p), k) for p in passed]
        metrics[f"pass@{k}"] = dict(zip(("value", "stderr"), mean_stderr(vals)))
    statuses: dict[str, int] = {}
    for r in results:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    metrics["sandbox"] = {"value": statuses, "stderr": 0.0}
    samples = [{"task_id": it.meta.get("task_id"), "responses": rs, "passed": p}
               for it, rs, p in zip(task.items, responses, passed)]
    return metrics, samples


SHORT_OPTION_TOKENS = 4  # options up to this long are scored token by token from the prefix cache


def option_logprobs(engine: Any, tokenizer: Any, items: list[Item]) -> list[list[float]]:
    """Sum of the log-probs of each option's tokens after its item's context, from the engine.

    Short options (MMLU's letters) are scored token by token: one next-token request per distinct prefix
    (context + the option's first j tokens), asking for the log-probs of every option token that follows it;
    those requests share their prefixes through the prefix cache. Longer options are scored whole by prompt
    log-probs (which vLLM computes without the cache)."""
    out: list[list[float]] = [[] for _ in items]
    prefixes: dict[tuple[int, ...], set[int]] = {}
    short: list[tuple[int, list[int], list[list[int]]]] = []
    seqs, spans = [], []
    for i, it in enumerate(items):
        ctx = tokenizer.encode(it.prompt)
        conts = [tokenizer.encode(c, add_special_tokens=False) for c in it.choices]
        if max(len(c) for c in conts) <= SHORT_OPTION_TOKENS:
            short.append((i, ctx, conts))
            for cont in conts:
                for j, tok in enumerate(cont):
                    prefixes.setdefault(tuple(ctx + cont[:j]), set()).add(tok)
        else:
            for cont in conts:
                seqs.append(ctx + cont)
                spans.append((i, len(ctx), len(cont)))
    if prefixes:
        keys = list(prefixes)
        lps = engine.next_token_logprobs([list(k) for k in keys], [sorted(prefixes[k]) for k in keys])
        table = {k: dict(zip(sorted(prefixes[k]), lp)) for k, lp in zip(keys, lps)}
        for i, ctx, conts in short:
            out[i] = [sum(table[tuple(ctx + c[:j])][t] for j, t in enumerate(c)) for c in conts]
    if seqs:
        scores = engine.score_all(seqs)[0]  # one engine's view is enough
        for lp, (i, start, n) in zip(scores, spans):
            out[i].append(sum(lp[start - 1:start - 1 + n]))
    return out


def _choice(engine: Any, tokenizer: Any, task: Task) -> tuple[dict, list]:
    lps = option_logprobs(engine, tokenizer, task.items)
    hits = [float(max(range(len(lp)), key=lp.__getitem__) == it.gold) for it, lp in zip(task.items, lps)]
    hits_norm = [float(max(range(len(lp)), key=lambda j: lp[j] / max(len(it.choices[j]), 1)) == it.gold)
                 for it, lp in zip(task.items, lps)]
    metrics = {"acc": dict(zip(("value", "stderr"), mean_stderr(hits))),
               "acc_norm": dict(zip(("value", "stderr"), mean_stderr(hits_norm)))}
    samples = [{"prompt": it.prompt, "gold": it.gold, "logprobs": lp} for it, lp in zip(task.items, lps)]
    return metrics, samples
