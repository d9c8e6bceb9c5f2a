"""The tool-use example task: "What is a*b?" for three-digit a, b, solved by calling `calculator`.

A ~1M-parameter policy cannot multiply three-digit numbers in its head (its accuracy without the tool is
about 0), but it can copy the operands into a calculator call and copy the result into its answer. The reward
is exact match of the number in the last model turn (`algorithms.rewards.exact_match`). Files written by
`write_multiply_tool_data(out_dir)`:
- `rl_train.jsonl`, `rl_val.jsonl`: `{"prompt", "messages", "answer"}` (as the arithmetic task);
- `sft_train.jsonl`, `sft_val.jsonl`: tool-call traces `{"messages": [user, assistant (the call), tool (the
  result), assistant (the answer)]}`, the call written as the agent loop parses it:
  `<tool_call>{"name": "calculator", "arguments": {"expression": "a*b"}}</tool_call>`. In `sft_train` (the
  warm start, 8000 train pairs) only `TOOL_SHARE` of the traces call the tool; the others answer directly
  `[user, assistant (the answer)]`. The warm-started policy can then copy operands and results but calls the
  tool for ~40% of its samples and greedily not at all, so its greedy accuracy is a guess's (~0%): what GRPO
  has to learn is that calling the tool pays. (Many distinct pairs matter: on a few hundred, the warm start
  memorises them and never learns to copy held-out operands.)
Validation pairs never appear in a train file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from rlhf.data.arithmetic import write_task_files
from rlhf.data.chat import CLOSE_CALL, OPEN_CALL
from rlhf.errors import UserError
from workers.agent.tools import load_tools, tool_schemas

LOW, HIGH = 100, 999
TOOL_SHARE = 0.4  # of the warm-start traces that call the calculator; the rest answer directly
Pair = tuple[int, int]


def split_pairs(seed: int = 0, val_size: int = 200, train_size: int = 20_000) -> tuple[list[Pair], list[Pair]]:
    """(train, val) of distinct three-digit pairs drawn with `seed`; no pair is in both."""
    if not 0 <= val_size <= 10_000:
        raise UserError(f"val_size must be in [0, 10000], got {val_size}")
    rng = random.Random(seed)
    seen: set[Pair] = set()
    while len(seen) < train_size + val_size:
        seen.add((rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)))
    pairs = sorted(seen)
    rng.shuffle(pairs)
    return pairs[val_size:], pairs[:val_size]


def question(a: int, b: int) -> str:
    return f"What is {a}*{b}?"


def call_text(expression: str) -> str:
    """An assistant turn calling the calculator, in the agent loop's tool-call format."""
    return OPEN_CALL + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + CLOSE_CALL


def rl_record(a: int, b: int) -> dict:
    q = question(a, b)
    return {"prompt": q, "messages": [{"role": "user", "content": q}], "answer": str(a * b)}


def trace_record(a: int, b: int) -> dict:
    """user question -> calculator call -> tool result -> the answer, with the calculator's schema as the
    record's `tools` (OpenAI's fine-tuning format; the rollout renders the same into its prompts)."""
    return {"tools": tool_schemas(load_tools(["calculator"])), "messages": [
        {"role": "user", "content": question(a, b)},
        {"role": "assistant", "content": call_text(f"{a}*{b}")},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": str(a * b)},
    ]}


def direct_record(a: int, b: int) -> dict:
    """user question -> the answer with no call (what a model without the tool writes: for this policy, a
    guess), with the calculator's schema in the prompt as in `trace_record`."""
    rec = trace_record(a, b)
    rec["messages"] = [rec["messages"][0], rec["messages"][-1]]
    return rec


def sft_record(k: int, pair: Pair) -> dict:
    """The k-th warm-start trace: a calculator-call trace for `TOOL_SHARE` of them, a direct answer else."""
    return trace_record(*pair) if k % 5 < round(5 * TOOL_SHARE) else direct_record(*pair)


def write_multiply_tool_data(out_dir: str | Path, seed: int = 0, val_size: int = 200,
                             sft_size: int = 8000) -> dict[str, Path]:
    """Write the four files listed in the module docstring into `out_dir`; return name -> path."""
    train, val = split_pairs(seed, val_size)
    return write_task_files(out_dir, {"rl_train": (train, rl_record), "rl_val": (val, rl_record),
                                      "sft_train": (list(enumerate(train[:sft_size])), sft_record),
                                      "sft_val": (val, trace_record)})
