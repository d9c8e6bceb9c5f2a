"""Pretraining datasets: megatron-core's GPTDataset through BlendedMegatronDatasetBuilder.

`build_pretrain_datasets(...)` returns (train, valid, test); each is a GPTDataset / BlendedDataset or None
(a split with weight 0). Items are dicts of torch tensors, S = seq_length:
- `tokens` [S] int64, `labels` [S] int64 (next-token targets), `loss_mask` [S] float32 (0 on pad labels,
  and on eod labels with eod_mask_loss), `position_ids` [S] int64;
- plus `attention_mask` [1, S, S] bool (True = masked) when create_attention_mask=True.
The sample order is seeded by `seed`; index caches go to `path_to_cache` (default: `<prefix>/cache/`,
as megatron-core does).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from rlhf.data.checks import parse_split
from rlhf.data.indexed import megatron_indexed, open_indexed
from rlhf.data.tokenizer import MegatronTokenizerAdapter, load_tokenizer
from rlhf.errors import UserError

SPLIT_NAMES = ("train", "valid", "test")


def ensure_dataset_helpers() -> None:
    """Make sure megatron-core's C++ index helpers import; compile them once if the wheel lacks them."""
    try:
        from megatron.core.datasets import helpers_cpp

        return
    except ImportError:
        pass
    import os

    from megatron.core.datasets import utils

    if not os.path.exists(os.path.join(os.path.dirname(utils.__file__), "Makefile")):
        raise UserError(
            "megatron-core's C++ dataset helpers (megatron.core.datasets.helpers_cpp) are missing and this "
            "install has no Makefile to build them; reinstall megatron-core from a wheel"
        )
    utils.compile_helpers()
    from megatron.core.datasets import helpers_cpp  # noqa: F401


@contextmanager
def _rank0_outside_process_group() -> Iterator[None]:
    """megatron-core 0.16.1's BlendedDataset calls torch.distributed.get_rank() on a cache miss even when no
    process group exists (it crashes with path_to_cache set in a single process). Outside a process group,
    answer rank 0 while building; inside one, change nothing."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    original = dist.get_rank
    dist.get_rank = lambda group=None: 0
    try:
        yield
    finally:
        dist.get_rank = original


def parse_blend(data_prefix: Sequence[Any]) -> tuple[list[str], list[float] | None]:
    """`[p]`, `[p1, p2, ...]` (weights from sizes) or `[w1, p1, w2, p2, ...]` -> (prefixes, weights)."""
    items = [str(x) for x in data_prefix]
    if not items:
        raise UserError("data_prefix is empty: give [prefix] or [weight1, prefix1, weight2, prefix2, ...]")

    def as_float(s: str) -> float | None:
        try:
            return float(s)
        except ValueError:
            return None

    if len(items) % 2 == 0 and all(as_float(items[i]) is not None for i in range(0, len(items), 2)):
        weights = [as_float(items[i]) for i in range(0, len(items), 2)]
        prefixes = items[1::2]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise UserError(f"data_prefix weights {weights} must be >= 0 and sum to more than 0")
        return prefixes, weights
    if any(as_float(s) is not None for s in items):
        raise UserError(
            f"data_prefix {items} mixes numbers and paths: give [prefix, ...] or [w1, prefix1, w2, prefix2, ...]"
        )
    return items, None


def _split_bounds(split: str, num_docs: int) -> list[tuple[int, int] | None]:
    """Document ranges per split exactly as megatron-core computes them (None for a zero-weight split)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
    return [None if m is None else (int(round(m[0] * num_docs)), int(round(m[1] * num_docs))) for m in matrix]


def check_prefixes_have_tokens(prefixes: list[str], split: str) -> None:
    """UserError for a prefix without .bin/.idx, or any non-empty split of a prefix with zero tokens
    (megatron-core's GPTDataset would loop forever on it)."""
    parse_split(split)
    for prefix in prefixes:
        indexed = open_indexed(prefix)
        # Copy while `indexed` is alive: its __del__ unmaps the buffer the lengths view points into.
        lengths = np.array(indexed.sequence_lengths, dtype=np.int64)
        del indexed
        if lengths.sum() == 0:
            raise UserError(
                f"data prefix {prefix} has zero tokens; re-run `rlhf preprocess` on non-empty data"
            )
        for name, bounds in zip(SPLIT_NAMES, _split_bounds(split, len(lengths))):
            if bounds is not None and lengths[bounds[0] : bounds[1]].sum() == 0:
                raise UserError(
                    f"data prefix {prefix}: split {split!r} leaves the {name} split with zero tokens "
                    f"({len(lengths)} documents in total); add data or give {name} weight 0"
                )


def build_pretrain_datasets(
    data_prefix: Sequence[Any],
    split: str,
    seq_length: int,
    seed: int,
    tokenizer_dir_or_obj: Any,
    num_samples: tuple[int | None, int | None, int | None],
    eod_mask_loss: bool = False,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    create_attention_mask: bool = False,
    path_to_cache: str | None = None,
) -> tuple[Any, Any, Any]:
    """Build (train, valid, test) megatron-core datasets from a blend of indexed prefixes; see module doc."""
    if not isinstance(seq_length, int) or seq_length <= 0:
        raise UserError(f"seq_length must be a positive integer, got {seq_length!r}")
    if len(num_samples) != 3:
        raise UserError(f"num_samples must be (train, valid, test), got {num_samples!r}")
    prefixes, weights = parse_blend(data_prefix)
    split_weights = parse_split(split)
    for name, w, n in zip(SPLIT_NAMES, split_weights, num_samples):
        if n and w == 0:
            raise UserError(f"{n} {name} samples requested but split {split!r} gives {name} weight 0")
    tokenizer = MegatronTokenizerAdapter(load_tokenizer(tokenizer_dir_or_obj))
    megatron_indexed()  # quiet import of megatron.core
    check_prefixes_have_tokens(prefixes, split)
    ensure_dataset_helpers()

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(prefixes, weights),
        split=split,
        tokenizer=tokenizer,
        reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
        path_to_cache=path_to_cache,
    )
    sizes = [None if n is None else int(n) for n in num_samples]
    with _rank0_outside_process_group():
        train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return train, valid, test
