"""The code-execution example task: write a tiny Python function from a description in words.

"Write a Python function f(x) that returns x times 3 plus 7." The answer is code (`def f(x):` and a return
line); the reward (`rlhf.eval.code:unit_test_pass_rate`) runs hidden tests (`assert f(..) == ..` on inputs
the prompt never shows) in the sandbox and scores the fraction that pass. Files written by
`write_code_data(out_dir)`:
- `rl_train.jsonl`, `rl_val.jsonl`: `{"prompt", "messages", "answer"}`, the answer a JSON list of the tests;
- `sft_train.jsonl`, `sft_val.jsonl`: `{"messages": [user, assistant (a reference solution)]}`, the first
  `sft_size` train tasks (the warm start), and every validation task.
Validation tasks (held out with the seed) never appear in a train file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rlhf.data.arithmetic import write_task_files
from rlhf.errors import UserError

OPS = {"plus": "+", "minus": "-", "times": "*"}
TEST_INPUTS = (0, 1, 5, -3)
Task = tuple[str, int, str, int]  # (op1 word, k1, op2 word, k2): x <op1> k1 <op2> k2


def all_tasks(max_constant: int = 20) -> list[Task]:
    return [(o1, k1, o2, k2) for o1 in OPS for k1 in range(1, max_constant + 1)
            for o2 in ("plus", "minus") for k2 in range(max_constant + 1)]


def split_tasks(seed: int = 0, val_size: int = 100) -> tuple[list[Task], list[Task]]:
    tasks = all_tasks()
    if not 0 <= val_size < len(tasks):
        raise UserError(f"val_size must be in [0, {len(tasks)}), got {val_size}")
    random.Random(seed).shuffle(tasks)
    return tasks[val_size:], tasks[:val_size]


def question(t: Task) -> str:
    return f"Write a Python function f(x) that returns x {t[0]} {t[1]} {t[2]} {t[3]}."


def solution(t: Task) -> str:
    return f"def f(x):\n    return (x {OPS[t[0]]} {t[1]}) {OPS[t[2]]} {t[3]}"


def tests(t: Task) -> list[str]:
    """The hidden tests: `assert f(x) == value` on inputs the prompt never shows."""
    value = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    out = []
    for x in TEST_INPUTS:
        y = value[OPS[t[2]]](value[OPS[t[0]]](x, t[1]), t[3])
        out.append(f"assert f({x}) == {y}")
    return out


def rl_record(t: Task) -> dict:
    q = question(t)
    return {"prompt": q, "messages": [{"role": "user", "content": q}], "answer": json.dumps(tests(t))}


def sft_record(t: Task) -> dict:
    return {"messages": [{"role": "user", "content": question(t)}, {"role": "assistant", "content": solution(t)}]}


def write_code_data(out_dir: str | Path, seed: int = 0, val_size: int = 100, sft_size: int = 300) -> dict[str, Path]:
    """Write the four files listed in the module docstring into `out_dir`; return name -> path."""
    train, val = split_tasks(seed, val_size)
    return write_task_files(out_dir, {"rl_train": (train, rl_record), "rl_val": (val, rl_record),
                                      "sft_train": (train[:sft_size], sft_record), "sft_val": (val, sft_record)},
                            unpack=False)
