"""The tiny arithmetic example task: "What is a+b?" for a, b in 0..99; the answer is the number a+b.

The reward is exact match of the number (`algorithms.rewards.exact_match`, which takes a boxed, `####` or
last number from the response), so the SFT target is just the number. Files written by
`write_arithmetic_data(out_dir)`:
- `rl_train.jsonl`, `rl_val.jsonl`: `{"prompt", "messages", "answer"}` (raw prompt and the same question as
  chat messages; pick one with `prompt_key` / `messages_key` in `load_prompt_dataset`);
- `sft_train.jsonl`, `sft_val.jsonl`: `{"messages": [user, assistant]}`;
- `pretrain.jsonl`: `{"text": "What is a+b? c"}` for the train pairs.
`write_preference_data(out_dir)` writes `dpo_train.jsonl`, `dpo_val.jsonl` (same split): `{"messages": [user],
"chosen": the sum, "rejected": a wrong sum}`, the wrong sum off by a seeded nonzero offset (`wrong_answer`).
With `name="rm", random_share=0.5` it writes the reward-model stage's `rm_train.jsonl`, `rm_val.jsonl`: half of
the rejected answers are a random wrong sum (`random_wrong_answer`) instead. A scalar head on the tiny preset
learns nothing from near misses alone (Bradley-Terry loss stays at log 2, in HF as on our stack: the head at
the end of turn must learn to redo the sum), while random wrong sums teach it which answers are plausible first.
Validation pairs (held out with the seed) never appear in the train, SFT-train or pretraining files.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from rlhf.errors import UserError

MAX_OPERAND = 99

Pair = tuple[int, int]


def all_pairs(max_operand: int = MAX_OPERAND) -> list[Pair]:
    """Every (a, b) with 0 <= a, b <= max_operand."""
    return [(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]


def split_pairs(
    seed: int = 0, val_size: int = 200, max_operand: int = MAX_OPERAND
) -> tuple[list[Pair], list[Pair]]:
    """(train, val): all pairs shuffled with `seed`, the first `val_size` held out."""
    pairs = all_pairs(max_operand)
    if not 0 <= val_size < len(pairs):
        raise UserError(f"val_size must be in [0, {len(pairs)}), got {val_size}")
    random.Random(seed).shuffle(pairs)
    return pairs[val_size:], pairs[:val_size]


def question(a: int, b: int) -> str:
    return f"What is {a}+{b}?"


def answer(a: int, b: int) -> str:
    return str(a + b)


def rl_record(a: int, b: int) -> dict:
    q = question(a, b)
    return {"prompt": q, "messages": [{"role": "user", "content": q}], "answer": answer(a, b)}


def sft_record(a: int, b: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": question(a, b)},
            {"role": "assistant", "content": answer(a, b)},
        ]
    }


# Offsets of the rejected answers: the near misses a model that half-learned addition makes (carry, last digit).
WRONG_OFFSETS = (-10, -2, -1, 1, 2, 10)


def wrong_answer(a: int, b: int, rng: random.Random) -> str:
    """A wrong but plausible sum: a + b plus a nonzero offset, never negative."""
    offsets = [d for d in WRONG_OFFSETS if a + b + d >= 0]
    return str(a + b + rng.choice(offsets))


def random_wrong_answer(a: int, b: int, rng: random.Random) -> str:
    """A wrong sum drawn uniformly from the possible sums 0..2 * MAX_OPERAND."""
    wrong = rng.randrange(2 * MAX_OPERAND)  # one fewer than the sums: skipping a + b keeps it uniform
    return str(wrong + (wrong >= a + b))


def preference_record(a: int, b: int, rng: random.Random, random_share: float = 0.0) -> dict:
    """A pair: the sum is chosen; the rejected answer is a random wrong sum with probability `random_share`,
    else a near miss."""
    wrong = random_wrong_answer if random_share and rng.random() < random_share else wrong_answer
    return {"messages": [{"role": "user", "content": question(a, b)}], "chosen": answer(a, b),
            "rejected": wrong(a, b, rng)}


def pretrain_record(a: int, b: int) -> dict:
    return {"text": f"{question(a, b)} {answer(a, b)}"}


def write_jsonl(path: str | Path, records: Iterable[dict]) -> int:
    """Write records one per line; return how many."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
            n += 1
    return n


def write_task_files(out_dir: str | Path, files: dict[str, tuple[Sequence[Any], Callable[..., dict]]],
                     unpack: bool = True) -> dict[str, Path]:
    """Write `<out_dir>/<name>.jsonl` for each `name: (items, make)`, one record per item: `make(*item)` (items
    are argument tuples, e.g. (a, b) pairs), or `make(item)` with `unpack=False`; return name -> path. Shared
    by the example tasks' generators."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, (items, make) in files.items():
        paths[name] = out / f"{name}.jsonl"
        write_jsonl(paths[name], (make(*it) if unpack else make(it) for it in items))
    return paths


def write_arithmetic_data(out_dir: str | Path, seed: int = 0, val_size: int = 200) -> dict[str, Path]:
    """Write the five files listed in the module docstring into `out_dir`; return name -> path."""
    train, val = split_pairs(seed, val_size)
    return write_task_files(out_dir, {
        "rl_train": (train, rl_record),
        "rl_val": (val, rl_record),
        "sft_train": (train, sft_record),
        "sft_val": (val, sft_record),
        "pretrain": (train, pretrain_record),
    })


def write_preference_data(out_dir: str | Path, seed: int = 0, val_size: int = 200, name: str = "dpo",
                          random_share: float = 0.0) -> dict[str, Path]:
    """Write `<name>_train.jsonl` and `<name>_val.jsonl` (module docstring) into `out_dir`; return file stem ->
    path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, val = split_pairs(seed, val_size)
    rng = random.Random(seed + 1)
    paths = {}
    for stem, pairs in ((f"{name}_train", train), (f"{name}_val", val)):
        paths[stem] = out / f"{stem}.jsonl"
        write_jsonl(paths[stem], (preference_record(a, b, rng, random_share) for a, b in pairs))
    return paths
