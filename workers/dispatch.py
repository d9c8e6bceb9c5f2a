"""Dispatch modes declared on worker methods, and the split / collect rules behind them.

A worker method is exposed on its `WorkerGroup` by decorating it with `@register(mode)`:

- `ONE_TO_ALL`: every rank gets the same arguments (init, load/save checkpoint, weight export).
  `collect="all"` returns the list of per-rank results (index = global rank), `collect="rank0"` the
  result of rank 0 only, `collect="flatten"` the per-rank lists concatenated in rank order.
- `DP_COMPUTE`: every `Batch` argument is split into `dp` contiguous shards; all TP/PP ranks of DP
  replica d get shard d; other arguments go to every rank as they are. Only the output ranks (last PP
  stage, TP rank 0) return data. Their `Batch` results are concatenated in DP order (padding rows
  removed); `dict` results (metrics the worker already reduced over DP) come from DP replica 0; other
  results come back as a list by DP rank. With `pad=True` a batch whose size does not divide by `dp` is
  padded by repeating its last row (right for inference; training methods use `pad=False`, which
  raises instead, because a duplicated sample would change the loss).
- `ALL_TO_ALL`: each argument is a list with one entry per rank; returns the list of per-rank results.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from workers.batch import Batch

ONE_TO_ALL = "one_to_all"
DP_COMPUTE = "dp_compute"
ALL_TO_ALL = "all_to_all"
MODES = (ONE_TO_ALL, DP_COMPUTE, ALL_TO_ALL)
_ATTR = "__dispatch_spec__"


@dataclass(frozen=True)
class DispatchSpec:
    """How a group call is fanned out to ranks and how the results are collected."""

    mode: str
    collect: str = "all"  # ONE_TO_ALL: "all" | "rank0" | "flatten"
    pad: bool = True  # DP_COMPUTE: pad the batch to a multiple of dp
    split: Callable | None = None  # DP_COMPUTE: custom (args, kwargs, dp, pad) -> (per-DP args, n_pad)


def register(mode: str = ONE_TO_ALL, collect: str = "all", pad: bool = True,
             split: Callable | None = None) -> Callable:
    """Declare a worker method's dispatch mode (see the module docstring).

    `split` replaces the contiguous DP split of `DP_COMPUTE` (e.g. `split_by_minibatch`).

    Inside the actor the method runs as written, except that for `DP_COMPUTE` the return value of
    non-output ranks is replaced by None (only the output ranks' data travels back).
    """
    if mode not in MODES:
        raise ValueError(f"unknown dispatch mode {mode!r}; known: {', '.join(MODES)}")
    if collect not in ("all", "rank0", "flatten"):
        raise ValueError(f"collect must be 'all', 'rank0' or 'flatten', got {collect!r}")
    spec = DispatchSpec(mode, collect, pad, split)

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            out = self._run_method(fn, args, kwargs)
            if mode == DP_COMPUTE and not getattr(self, "is_output_rank", True):
                return None
            return out

        setattr(wrapper, _ATTR, spec)
        return wrapper

    return deco


def get_spec(cls: type, name: str) -> DispatchSpec | None:
    """The dispatch spec of `cls.name`, or None when it is not a registered method."""
    return getattr(getattr(cls, name, None), _ATTR, None)


def split_dp_args(args: Sequence[Any], kwargs: dict[str, Any], dp: int, pad: bool
                  ) -> tuple[list[tuple[list[Any], dict[str, Any]]], int]:
    """Per-DP-rank (args, kwargs): every Batch is split into `dp` shards, the rest is repeated.

    Returns the shards and the number of padding rows appended (0 when the size divides by `dp`).
    All Batch arguments must have the same size.
    """
    sizes = {len(a) for a in list(args) + list(kwargs.values()) if isinstance(a, Batch)}
    if len(sizes) > 1:
        raise ValueError(f"DP_COMPUTE batch arguments have different sizes: {sorted(sizes)}")
    n_pad = 0
    if sizes:
        size = sizes.pop()
        if size % dp and not pad:
            raise ValueError(
                f"batch of {size} samples does not divide by the data-parallel size {dp}; "
                f"this method does not pad (a duplicated sample would change the result)"
            )
        n_pad = (-size) % dp

    def shards(a: Any) -> list[Any]:
        if not isinstance(a, Batch):
            return [a] * dp
        padded, _ = a.pad_to_multiple(dp)
        return padded.split(dp)

    split_args = [shards(a) for a in args]
    split_kwargs = {k: shards(v) for k, v in kwargs.items()}
    per_rank = [([s[d] for s in split_args], {k: v[d] for k, v in split_kwargs.items()}) for d in range(dp)]
    return per_rank, n_pad


def collect_one_to_all(results: list[Any], collect: str) -> Any:
    """Combine the per-rank results of a ONE_TO_ALL call."""
    if collect == "rank0":
        return results[0]
    if collect == "flatten":
        return [x for r in results if r for x in r]
    return list(results)


def collect_dp(outputs: Sequence[Any], n_pad: int) -> Any:
    """Combine the output ranks' results (in DP order) of a DP_COMPUTE call (see module docstring)."""
    if outputs and all(isinstance(o, Batch) for o in outputs):
        merged = Batch.concat(list(outputs))
        return merged.index(slice(0, len(merged) - n_pad)) if n_pad else merged
    if outputs and all(isinstance(o, dict) for o in outputs):
        return outputs[0]
    return list(outputs)


def split_by_minibatch(config_arg: int = 1, config_kw: str = "loss_config", key: str = "mini_batches") -> Callable:
    """A DP split for training: DP shard d holds its part of *every* mini-batch, so mini-batch i of the
    whole batch (rows [i*M, (i+1)*M)) is the union of the shards' i-th chunks, for any DP size.

    The number of mini-batches is read from the config argument (positional index `config_arg` or
    keyword `config_kw`, a dict or object with attribute/key `key`; 1 if absent). The batch size must
    divide by mini_batches * dp.
    """

    def split(args: Sequence[Any], kwargs: dict[str, Any], dp: int, pad: bool):
        cfg = kwargs.get(config_kw, args[config_arg] if len(args) > config_arg else None)
        m = cfg.get(key, 1) if isinstance(cfg, dict) else getattr(cfg, key, 1) if cfg is not None else 1
        m = int(m or 1)

        def reorder(b: Any) -> Any:
            if not isinstance(b, Batch):
                return b
            if len(b) % (m * dp):
                raise ValueError(f"batch of {len(b)} samples does not divide into {m} mini-batch(es) x {dp} "
                                 f"data-parallel rank(s)")
            size, part = len(b) // m, len(b) // (m * dp)
            order = [i * size + d * part + j for d in range(dp) for i in range(m) for j in range(part)]
            return b.index(order)

        return split_dp_args([reorder(a) for a in args], {k: reorder(v) for k, v in kwargs.items()}, dp, pad=False)

    return split
