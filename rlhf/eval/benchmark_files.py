"""Evaluation data from files in the benchmarks' own layouts, checked row by row (a bad row is one line naming
file:line and the field), with few-shot examples taken from the file's first rows or from a second file.

`mc:<file>` (MMLU CSV: question, A, B, C, D, answer without a header; C-Eval CSV with a header; or jsonl with
question, choices, answer), `gsm8k:<file>` (jsonl: question, answer ending `#### N`), `math:<file>` (jsonl:
problem, solution, optionally answer), `prompts:<file>` (our prompt files: messages or prompt, and answer).
`<file>@<examples file>` takes the few-shot examples from the second file (e.g. MMLU's dev split)."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf.errors import UserError
from rlhf.eval.items import Item, Task
from rlhf.eval.scoring import last_number, math_equal, numbers_equal

LETTERS = "ABCDEFGHIJ"
Row = tuple[int, Any]  # (line, the row's parsed fields)


def split_files(name: str, arg: str) -> tuple[Path, Path | None]:
    """The data file and the optional few-shot file of `<file>[@<examples file>]`, both checked to exist."""
    data, _, shots = arg.partition("@")
    paths = [Path(data)] + ([Path(shots)] if shots else [])
    for p in paths:
        if not p.is_file():
            raise UserError(f"task {name}: data file {p} not found (provide it in the benchmark's layout)")
    return paths[0], (paths[1] if shots else None)


def fewshot_rows(name: str, rows: list[Row], shot_rows: list[Row] | None, k: int, source: Path) -> tuple[list, list]:
    """(examples, scored rows): the first `k` rows of the examples file, or of the data file itself (which
    are then not scored)."""
    pool = rows if shot_rows is None else shot_rows
    if k > len(pool) - (1 if shot_rows is None else 0):
        have = len(pool) if shot_rows is not None else f"{len(pool)} rows, one at least left to score"
        raise UserError(f"task {name}: --num-fewshot {k} needs {k} example rows but {source} has {have}")
    return pool[:k], (rows[k:] if shot_rows is None else rows)


def load_file_task(kind: str, name: str, arg: str, num_fewshot: int) -> Task:
    data, shots = split_files(name, arg)
    parse, build = _KINDS[kind]
    rows = parse(data)
    examples, scored = fewshot_rows(name, rows, parse(shots) if shots else None, num_fewshot, shots or data)
    task = build(data, examples, scored)
    task.name = name
    task.short = f"{kind}:{data.stem}"
    task.config = {"file": str(data), "fewshot_file": str(shots) if shots else None, "num_fewshot": num_fewshot}
    return task


# ---- reading ---------------------------------------------------------------------------------------------

def _type(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def jsonl_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    from rlhf.data.jsonl import read_jsonl

    return list(read_jsonl(path))


def need_field(path: Path, line: int, row: dict, key: str, expected: str, ok: Callable[[Any], bool]) -> Any:
    if key not in row:
        raise UserError(f"{path}:{line}: missing field {key!r} ({expected})")
    if not ok(row[key]):
        raise UserError(f"{path}:{line}: field {key!r} must be {expected}, got {_type(row[key])} {row[key]!r:.60}")
    return row[key]


def need_text(path: Path, line: int, row: dict, key: str, what: str = "a non-empty string") -> str:
    return need_field(path, line, row, key, what, lambda v: isinstance(v, str) and bool(v.strip()))


def _answer_index(path: Path, line: int, ans: Any, n: int) -> int:
    """An answer letter (A..) or a 0-based index into the n choices; booleans are neither."""
    letters = LETTERS[:n]
    if isinstance(ans, str) and len(ans.strip()) == 1 and ans.strip().upper() in letters:
        return letters.index(ans.strip().upper())
    if isinstance(ans, int) and not isinstance(ans, bool) and 0 <= ans < n:
        return ans
    raise UserError(f"{path}:{line}: field 'answer' must be a letter {letters[0]}-{letters[-1]} or an index "
                    f"0-{n - 1} into 'choices', got {_type(ans)} {ans!r:.40}")


# ---- multiple choice -------------------------------------------------------------------------------------

def _mc_rows(path: Path) -> list[Row]:
    return _mc_csv(path) if path.suffix == ".csv" else _mc_jsonl(path)


def _mc_csv(path: Path) -> list[Row]:
    """MMLU (no header: question, A, B, C, D, answer) or C-Eval (a header naming question, A-D, answer)."""
    try:
        with path.open(newline="", encoding="utf-8") as f:
            table = list(csv.reader(f))
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
    except csv.Error as e:
        raise UserError(f"{path}: not a readable CSV ({e})") from None
    first = [c.strip().lower() for c in table[0]] if table else []
    header = first if "question" in first else []
    if header:
        letters = [c.upper() for c in header if len(c) == 1 and c.upper() in LETTERS]
        for need in ("question", "answer"):
            if need not in header:
                raise UserError(f"{path}:1: the header has no column {need!r} (C-Eval layout: id, question, A, B, "
                                "C, D, answer)")
        if len(letters) < 2:
            raise UserError(f"{path}:1: the header names fewer than two option columns (A, B, ...)")
        fields = ["question", *[c.lower() for c in letters], "answer"]
    rows: list[Row] = []
    for line, rec in enumerate(table[1 if header else 0:], 2 if header else 1):
        if not any(c.strip() for c in rec):
            continue
        if header:
            at = {k: header.index(k) for k in fields}
            missing = next((k for k in fields if at[k] >= len(rec)), None)
            if missing:
                shown = missing.upper() if len(missing) == 1 else missing
                raise UserError(f"{path}:{line}: {len(rec)} columns, no value for field '{shown}'")
            rec = [rec[at[k]] for k in fields]
        elif len(rec) < 4:
            raise UserError(f"{path}:{line}: {len(rec)} columns; expected question, A, B, C, D, answer (MMLU layout)")
        question, options, ans = rec[0], rec[1:-1], rec[-1].strip().upper()
        if not question.strip():
            raise UserError(f"{path}:{line}: field 'question' (column 1) is empty")
        letters = LETTERS[:len(options)]
        if len(ans) != 1 or ans not in letters:
            raise UserError(f"{path}:{line}: field 'answer' (column {len(rec)}) is {rec[-1]!r}; expected a letter "
                            f"{letters[0]}-{letters[-1]}")
        rows.append((line, (question, options, letters.index(ans))))
    return rows


def _mc_jsonl(path: Path) -> list[Row]:
    rows: list[Row] = []
    for line, rec in jsonl_rows(path):
        question = need_text(path, line, rec, "question")
        choices = need_field(path, line, rec, "choices", f"a list of 2 to {len(LETTERS)} options",
                         lambda v: isinstance(v, list) and 2 <= len(v) <= len(LETTERS)
                         and all(isinstance(c, (str, int, float)) and not isinstance(c, bool) for c in v))
        need_field(path, line, rec, "answer", "a letter or an index", lambda v: True)
        rows.append((line, (question, [str(c) for c in choices], _answer_index(path, line, rec["answer"], len(choices)))))
    return rows


def _mc_block(question: str, choices: list[str]) -> str:
    return question.strip() + "\n" + "".join(f"{LETTERS[i]}. {c}\n" for i, c in enumerate(choices)) + "Answer:"


def _mc_task(path: Path, examples: list[Row], rows: list[Row]) -> Task:
    """MMLU's prompt (as lm-evaluation-harness writes it): a subject line, the examples with their answer
    letters, the question; the options scored are ` A`, ` B`, ..."""
    subject = path.stem.replace("_test", "").replace("_val", "").replace("_dev", "").replace("_", " ")
    head = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
    shots = "".join(_mc_block(q, ch) + f" {LETTERS[a]}\n\n" for _, (q, ch, a) in examples)
    items = [Item(head + shots + _mc_block(q, ch), a, choices=[f" {LETTERS[i]}" for i in range(len(ch))],
                  meta={"line": line}) for line, (q, ch, a) in rows]
    return Task("mc", "choice", items)


# ---- generation --------------------------------------------------------------------------------------------

def _chat(examples: list[tuple[list[dict[str, str]], str]], messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """`messages` with the examples (their turns and answers) inserted after any leading system turns."""
    cut = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    shots = [m for turns, answer in examples for m in (*[t for t in turns if t.get("role") != "system"],
                                                       {"role": "assistant", "content": answer})]
    return [*messages[:cut], *shots, *messages[cut:]]


def _gsm8k_rows(path: Path) -> list[Row]:
    rows: list[Row] = []
    for line, rec in jsonl_rows(path):
        question = need_text(path, line, rec, "question")
        answer = need_text(path, line, rec, "answer", "a string ending '#### <number>' (GSM8K layout)")
        final = last_number(answer.split("####")[-1]) if "####" in answer else None
        if final is None:
            raise UserError(f"{path}:{line}: field 'answer' has no '#### <number>' final answer (GSM8K layout)")
        rows.append((line, (question, answer, final)))
    return rows


def _gsm8k_task(path: Path, examples: list[Row], rows: list[Row]) -> Task:
    shots = [([{"role": "user", "content": q}], a) for _, (q, a, _) in examples]
    items = [Item(_chat(shots, [{"role": "user", "content": q}]), gold, meta={"line": line})
             for line, (q, _, gold) in rows]
    return Task("gsm8k", "generate", items, score=lambda it, r: float(numbers_equal(last_number(r), it.gold)))


def _math_rows(path: Path) -> list[Row]:
    rows: list[Row] = []
    for line, rec in jsonl_rows(path):
        problem = need_text(path, line, rec, "problem")
        solution = need_text(path, line, rec, "solution")
        gold = need_text(path, line, rec, "answer") if "answer" in rec else solution
        rows.append((line, (problem, solution, gold)))
    return rows


def _math_task(path: Path, examples: list[Row], rows: list[Row]) -> Task:
    shots = [([{"role": "user", "content": p}], s) for _, (p, s, _) in examples]
    items = [Item(_chat(shots, [{"role": "user", "content": p}]), gold, meta={"line": line})
             for line, (p, _, gold) in rows]
    return Task("math", "generate", items, score=lambda it, r: float(math_equal(r, it.gold)))


def _prompt_rows(path: Path) -> list[Row]:
    rows: list[Row] = []
    for line, rec in jsonl_rows(path):
        answer = need_field(path, line, rec, "answer", "a string or a number",
                        lambda v: isinstance(v, (str, int, float)) and not isinstance(v, bool))
        if isinstance(rec.get("messages"), list) and all(isinstance(m, dict) for m in rec["messages"]):
            messages = rec["messages"]
        elif isinstance(rec.get("prompt"), str):
            messages = [{"role": "user", "content": rec["prompt"]}]
        else:
            raise UserError(f"{path}:{line}: expected a field 'prompt' (a string) or 'messages' (a list of messages)")
        rows.append((line, (messages, str(answer))))
    return rows


def _prompts_task(path: Path, examples: list[Row], rows: list[Row]) -> Task:
    from algorithms.rewards import get_reward_fn

    exact = get_reward_fn("exact_match")
    shots = [(m, a) for _, (m, a) in examples]
    items = [Item(_chat(shots, m), a, meta={"line": line}) for line, (m, a) in rows]
    return Task("prompts", "generate", items, score=lambda it, r: float(exact(it.prompt, r, it.gold)))


_KINDS: dict[str, tuple[Callable[[Path], list[Row]], Callable[[Path, list[Row], list[Row]], Task]]] = {
    "mc": (_mc_rows, _mc_task), "gsm8k": (_gsm8k_rows, _gsm8k_task), "math": (_math_rows, _math_task),
    "prompts": (_prompt_rows, _prompts_task),
}
FILE_KINDS = tuple(_KINDS)
