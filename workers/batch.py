"""`Batch`: the one container passed between the driver and the worker groups.

It holds per-sample tensors (leading dim B), per-sample non-tensor data (lists of length B) and
batch-level info (a plain dict, e.g. metrics). The worker group splits it by data-parallel rank and
concatenates the results in the original order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# The tensors of a pretraining / SFT batch, each [B, S] (layout in workers/roles/lm.py).
LM_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, list] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._check()

    def _check(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items()} | {k: len(v) for k, v in self.meta.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch fields disagree on the batch size: {sizes}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.meta.values():
            return len(v)
        return 0

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.meta

    def __getitem__(self, key: str) -> Any:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.meta:
            return self.meta[key]
        raise KeyError(f"Batch has no field {key!r}; it has {sorted(self.tensors) + sorted(self.meta)}")

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self.meta.pop(key, None)
            self.tensors[key] = value
        else:
            self.tensors.pop(key, None)
            self.meta[key] = list(value)
        self._check()

    def keys(self) -> list[str]:
        return list(self.tensors) + list(self.meta)

    def select(self, keys: Iterable[str]) -> Batch:
        """A batch with only `keys` (tensors are shared, not copied)."""
        keys = list(keys)
        return Batch(
            {k: self.tensors[k] for k in keys if k in self.tensors},
            {k: self.meta[k] for k in keys if k in self.meta},
            dict(self.info),
        )

    def index(self, idx: Sequence[int] | torch.Tensor | slice) -> Batch:
        """Rows `idx` (a slice, a list of indices or a bool/long tensor), in that order."""
        if isinstance(idx, slice):
            rows = list(range(len(self)))[idx]
        elif isinstance(idx, torch.Tensor):
            rows = (idx.nonzero().flatten() if idx.dtype == torch.bool else idx).tolist()
        else:
            rows = list(idx)
        t = torch.as_tensor(rows, dtype=torch.long)
        return Batch(
            {k: v.index_select(0, t) if rows else v[:0] for k, v in self.tensors.items()},
            {k: [v[i] for i in rows] for k, v in self.meta.items()},
            dict(self.info),
        )

    def split(self, n: int) -> list[Batch]:
        """`n` contiguous chunks of equal size; the batch size must divide by `n`."""
        size = len(self)
        if n < 1 or size % n:
            raise ValueError(f"cannot split a batch of {size} samples into {n} equal parts")
        step = size // n
        return [self.index(slice(i * step, (i + 1) * step)) for i in range(n)]

    def chunks(self, chunk_size: int) -> list[Batch]:
        """Contiguous chunks of at most `chunk_size` samples (the last may be shorter)."""
        return [self.index(slice(i, i + chunk_size)) for i in range(0, len(self), chunk_size)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Concatenate along the batch dim. Tensors of different widths are right-padded with 0."""
        batches = [b for b in batches if b is not None]
        if not batches:
            return Batch()
        keys_t, keys_m = list(batches[0].tensors), list(batches[0].meta)
        for b in batches[1:]:
            if list(b.tensors) != keys_t or list(b.meta) != keys_m:
                raise ValueError(f"cannot concat batches with different fields: {b.keys()} vs {keys_t + keys_m}")
        tensors = {}
        for k in keys_t:
            parts = [b.tensors[k] for b in batches]
            if parts[0].dim() >= 2 and len({p.shape[1] for p in parts}) > 1:
                width = max(p.shape[1] for p in parts)
                parts = [torch.nn.functional.pad(p, (0, 0) * (p.dim() - 2) + (0, width - p.shape[1])) for p in parts]
            tensors[k] = torch.cat(parts)
        meta = {k: [x for b in batches for x in b.meta[k]] for k in keys_m}
        info: dict[str, Any] = {}
        for b in batches:
            info.update(b.info)
        return Batch(tensors, meta, info)

    def union(self, other: Batch) -> Batch:
        """Fields of both batches (same size); `other` wins on clashes."""
        if len(other) and len(self) and len(other) != len(self):
            raise ValueError(f"cannot union batches of sizes {len(self)} and {len(other)}")
        return Batch({**self.tensors, **other.tensors}, {**self.meta, **other.meta}, {**self.info, **other.info})

    def pad_to_multiple(self, multiple: int) -> tuple[Batch, int]:
        """Repeat the last rows so the size divides by `multiple`; return the batch and the pad count."""
        pad = (-len(self)) % multiple
        if pad == 0:
            return self, 0
        idx = list(range(len(self))) + [len(self) - 1] * pad
        return self.index(idx), pad

    def to(self, device: str | torch.device) -> Batch:
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.meta, self.info)


def pad_sequences(seqs: Sequence[Sequence[int] | torch.Tensor], pad_value: int = 0, left: bool = False,
                  dtype: torch.dtype = torch.long) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad 1-D sequences into [B, max_len]; return (padded, mask) with mask 1 on real tokens."""
    tensors = [torch.as_tensor(s, dtype=dtype) for s in seqs]
    width = max((t.numel() for t in tensors), default=0)
    out = torch.full((len(tensors), width), pad_value, dtype=dtype)
    mask = torch.zeros((len(tensors), width), dtype=torch.long)
    for i, t in enumerate(tensors):
        n = t.numel()
        if left:
            out[i, width - n:], mask[i, width - n:] = t, 1
        else:
            out[i, :n], mask[i, :n] = t, 1
    return out, mask
