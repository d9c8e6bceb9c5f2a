"""RL prompt sets: `load_prompt_dataset` (local jsonl or parquet, never a hub) and the resumable `PromptLoader`.

Each prompt is `{"prompt": str | None, "messages": list[{"role", "content"}] | None, "ground_truth": str}`:
raw-text prompts fill `prompt`, chat prompts (`messages_key` set) fill `messages`. Prompts read from
WebDataset shards (vision-language tasks) also carry `images` (encoded bytes) and their messages' content
may be a list of image and text parts. With a `PromptLimit`,
prompts too long for the model's context are dropped (counted) or refused when the file is read.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf.data.jsonl import check_input_file, read_jsonl
from rlhf.errors import UserError

PromptRecord = dict[str, Any]


@dataclass
class PromptLimit:
    """The most tokens a prompt may have (after the chat template) so that it and the completion fit the
    model's context; `count` gives the token length of each record, `explain` spells the arithmetic out.
    mode "drop" skips longer prompts and counts them in `dropped` (file -> (count, first location));
    "fail" raises a UserError naming the first one's file:line."""

    max_prompt_tokens: int
    explain: str
    count: Callable[[list[PromptRecord]], list[int]]
    mode: str = "drop"
    dropped: dict[str, tuple[int, str]] = field(default_factory=dict)

    def apply(self, records: list[PromptRecord], wheres: list[str], path: Path) -> list[PromptRecord]:
        """`records` without the over-long ones (mode drop), or a UserError at the first one (mode fail)."""
        kept = []
        for rec, where, n in zip(records, wheres, self.count(records), strict=True):
            if n <= self.max_prompt_tokens:
                kept.append(rec)
                continue
            if self.mode == "fail":
                raise UserError(f"{where}: the prompt has {n} tokens (after the chat template), more than "
                                f"{self.explain}; data.overlong_prompts=drop skips such prompts")
            count, first = self.dropped.get(str(path), (0, where))
            self.dropped[str(path)] = (count + 1, first)
        return kept

    def summary(self) -> str:
        """One line per file with dropped prompts, or "" when none were."""
        return "\n".join(
            f"{path}: dropped {count} prompt(s) longer than {self.explain} tokens (first at {first}; "
            "data.overlong_prompts=fail refuses them)"
            for path, (count, first) in self.dropped.items()
        )


def _read_records(path: Path) -> Iterator[tuple[int, dict]]:
    """(line or row number, record); jsonl is pre-scanned line by line so errors name file:line."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        yield from read_jsonl(path)
    elif suffix == ".parquet":
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        import datasets
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(str(path))
        except Exception as e:  # pyarrow raises several types for a broken file
            raise UserError(f"{path}: cannot read parquet: {e}") from e
        yield from enumerate(datasets.Dataset(table), start=1)
    else:
        raise UserError(f"{path}: unsupported prompt file type {suffix!r}; use .jsonl or .parquet")


def _as_messages(value: Any, where: str, key: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise UserError(f"{where}: {key!r} must be a non-empty list of {{'role', 'content'}} messages")
    for i, m in enumerate(value):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise UserError(f"{where}: {key!r}[{i}] must be an object with string 'role' and 'content'")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def is_shard_source(path: str | Path) -> bool:
    """True for WebDataset shards (a folder of .tar shards, one .tar, or a brace pattern)."""
    p = Path(path)
    return p.is_dir() or p.suffix == ".tar" or "{" in str(path)


def read_shard_prompts(path: str | Path, limit: PromptLimit | None = None) -> list[PromptRecord]:
    """RL prompts from LLaVA-format WebDataset shards (`rlhf preprocess --format llava`): each sample's
    conversation without its final assistant turn is the prompt, that turn the ground truth; the images ride
    along as encoded bytes (`images`)."""
    from rlhf.data.llava_shards import iter_llava_shards

    out: list[PromptRecord] = []
    wheres: list[str] = []
    for sample in iter_llava_shards(path):
        msgs = sample["messages"]
        where = f"{path} sample {sample['key']} (id {sample['id']!r})"
        if len(msgs) < 2 or msgs[-1]["role"] != "assistant":
            raise UserError(f"{where}: the conversation must end with the assistant's answer (the ground truth)")
        out.append({"prompt": None, "messages": msgs[:-1], "ground_truth": str(msgs[-1]["content"]),
                    "images": list(sample["images"])})
        wheres.append(where)
    if limit is not None and out:
        out = limit.apply(out, wheres, Path(path))
    if not out:
        raise UserError(f"{path}: no prompts")
    return out


def read_prompt_file(
    path: str | Path,
    prompt_key: str = "prompt",
    messages_key: str | None = None,
    answer_key: str = "answer",
    limit: PromptLimit | None = None,
) -> list[PromptRecord]:
    """All prompts of one file, fields mapped; a missing key names the key and the first offending line.
    With `limit`, over-long prompts are dropped or refused (see PromptLimit). WebDataset shards (image
    prompts): `read_shard_prompts`."""
    if is_shard_source(path):
        return read_shard_prompts(path, limit)
    p = check_input_file(path, "prompt file")
    unit = "row" if p.suffix.lower() == ".parquet" else "line"
    source_key = messages_key or prompt_key
    missing: dict[str, tuple[int, int]] = {}  # key -> (first line, count)
    out: list[PromptRecord] = []
    wheres: list[str] = []
    for n, rec in _read_records(p):
        absent = [k for k in (source_key, answer_key) if rec.get(k) is None]
        for k in absent:
            first, count = missing.get(k, (n, 0))
            missing[k] = (first, count + 1)
        if absent:
            continue
        where = f"{p}:{n}" if unit == "line" else f"{p} row {n}"
        wheres.append(where)
        answer = rec[answer_key]
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise UserError(
                f"{where}: {answer_key!r} is {type(answer).__name__}, expected a string or number"
            )
        if messages_key:
            out.append(
                {
                    "prompt": None,
                    "messages": _as_messages(rec[messages_key], where, messages_key),
                    "ground_truth": str(answer),
                }
            )
        else:
            if not isinstance(rec[prompt_key], str):
                raise UserError(
                    f"{where}: {prompt_key!r} is {type(rec[prompt_key]).__name__}, expected a string"
                )
            out.append({"prompt": rec[prompt_key], "messages": None, "ground_truth": str(answer)})
    if missing:
        key, (first, count) = next(iter(missing.items()))
        raise UserError(f"{p}: key {key!r} missing in {count} {unit}(s), first at {unit} {first}")
    if limit is not None and out:
        out = limit.apply(out, wheres, p)
        if not out:
            raise UserError(f"{p}: no prompts left: every prompt is longer than {limit.explain} tokens")
    if not out:
        raise UserError(f"{p}: no prompts")
    return out


def load_prompt_dataset(
    train_file: str | Path,
    val_file: str | Path | None = None,
    val_size: int | float = 0,
    prompt_key: str = "prompt",
    messages_key: str | None = None,
    answer_key: str = "answer",
    seed: int = 0,
    limit: PromptLimit | None = None,
) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(train, val) prompt lists, each shuffled with `seed`.

    val comes from `val_file`, or else `val_size` prompts (an int, or a fraction in (0, 1)) are held out of
    the shuffled train file; with neither, val is empty. `limit` drops or refuses over-long prompts first.
    """
    keys: dict[str, Any] = dict(prompt_key=prompt_key, messages_key=messages_key, answer_key=answer_key,
                                limit=limit)
    if val_file is not None and val_size:
        raise UserError("give either val_file or val_size, not both")
    if isinstance(val_size, bool) or not isinstance(val_size, int | float) or val_size < 0:
        raise UserError(f"val_size must be a non-negative int or a fraction in (0, 1), got {val_size!r}")
    train = read_prompt_file(train_file, **keys)
    val = read_prompt_file(val_file, **keys) if val_file is not None else []
    rng = random.Random(seed)
    rng.shuffle(train)
    rng.shuffle(val)
    if val_size:
        n_val = (
            int(round(val_size * len(train)))
            if isinstance(val_size, float) and val_size < 1
            else int(val_size)
        )
        if not 0 < n_val < len(train):
            raise UserError(
                f"val_size {val_size} leaves no train prompts or no val prompts ({len(train)} in total)"
            )
        val, train = train[:n_val], train[n_val:]
    return train, val


class PromptLoader:
    """Fixed-size batches of prompts in a seeded order per epoch; resumable via state_dict().

    Each epoch is a fresh permutation (seeded by seed and epoch); a remainder smaller than batch_size is
    dropped. The state is (epoch, position) with position counted in prompts, so a resumed run may change
    batch_size.
    """

    def __init__(
        self, prompts: list[PromptRecord], batch_size: int, seed: int = 0, shuffle: bool = True
    ) -> None:
        if batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {batch_size}")
        if batch_size > len(prompts):
            raise UserError(f"batch_size {batch_size} is larger than the {len(prompts)} prompts")
        self.prompts = prompts
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    @property
    def batches_per_epoch(self) -> int:
        return len(self.prompts) // self.batch_size

    def next_batch(self, size: int | None = None) -> list[PromptRecord]:
        """The next `size` prompts (default batch_size), moving to the next epoch when fewer remain."""
        size = self.batch_size if size is None else min(size, len(self.prompts))
        if self.position + size > len(self.prompts):
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order(self.epoch)
        idx = self._order[self.position : self.position + size]
        self.position += size
        return [self.prompts[i] for i in idx]

    def __iter__(self) -> Iterator[list[PromptRecord]]:
        """Batches forever (epochs roll over); stop by step count."""
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_prompts": len(self.prompts),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("num_prompts") != len(self.prompts) or state.get("seed", self.seed) != self.seed:
            raise UserError(
                f"prompt loader state was saved for {state.get('num_prompts')} prompts with seed "
                f"{state.get('seed')}; this run has {len(self.prompts)} prompts with seed {self.seed}"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)
