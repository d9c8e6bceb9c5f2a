"""Packing HF-named tensors into flat buckets of bounded size, and unpacking them as views.

A bucket is one contiguous 1-D tensor of the engine's dtype plus a `BucketMeta` (names, shapes,
offsets). Tensors are grouped by the module vLLM may fuse (`group_key`: `model.layers.3.self_attn`
holds q/k/v, `model.layers.3.mlp` gate/up/down), and a group never straddles two buckets: vLLM's
in-place reload processes a layer only once all its tensors arrived, so keeping groups whole keeps the
receiver's extra memory at about one bucket. A group larger than the bucket size gets a bucket of its
own (the bound is then max(bucket size, largest group)).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unsupported weight dtype {name!r}; one of {list(DTYPES)}")
    return DTYPES[name]


@dataclass
class BucketMeta:
    """What a receiver needs to cut a bucket back into named tensors."""

    index: int
    dtype: str
    names: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # element offsets
    numel: int = 0

    @property
    def nbytes(self) -> int:
        return self.numel * torch_dtype(self.dtype).itemsize


def group_key(name: str) -> str:
    """The unit a bucket never splits: `<...>.layers.<i>.<sub>` inside a layer, else the owning module."""
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        if i + 2 < len(parts):
            return ".".join(parts[: i + 3])
    return ".".join(parts[:-1])


def unpack(buf: torch.Tensor, meta: BucketMeta) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view) pairs of a received bucket, without copying."""
    for name, shape, off in zip(meta.names, meta.shapes, meta.offsets):
        n = 1
        for s in shape:
            n *= s
        yield name, buf[off:off + n].view(shape)


class BucketPacker:
    """Streams (name, tensor) pairs into buckets of at most `bucket_bytes` (whole groups only).

    The packing buffer is allocated once and reused, so a transport must finish with a bucket (send it
    or copy it) before asking for the next; `buckets()` yields (buffer view, meta).
    """

    def __init__(self, bucket_bytes: int, dtype: str | torch.dtype, device: str | torch.device = "cpu") -> None:
        self.dtype = torch_dtype(dtype)
        self.dtype_name = str(self.dtype).replace("torch.", "")
        self.capacity = max(1, int(bucket_bytes) // self.dtype.itemsize)
        self.device = torch.device(device)
        self._buf: torch.Tensor | None = None
        self.num_buckets = 0
        self.num_tensors = 0
        self.total_bytes = 0
        self.max_bucket_bytes = 0

    def _buffer(self, numel: int) -> torch.Tensor:
        need = max(numel, self.capacity)
        if self._buf is None or self._buf.numel() < need:
            self._buf = torch.empty(need, dtype=self.dtype, device=self.device)
        return self._buf

    def buckets(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[torch.Tensor, BucketMeta]]:
        """Consume `weights` and yield full buckets in order (each valid until the next is requested)."""
        self._meta = BucketMeta(0, self.dtype_name)
        group: list[tuple[str, torch.Tensor]] = []
        key = None
        for name, tensor in weights:
            k = group_key(name)
            if group and k != key:
                yield from self._place(group)
                group = []
            key = k
            group.append((name, tensor))
        if group:
            yield from self._place(group)
        if self._meta.names:
            yield self._emit()

    def _place(self, group: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[torch.Tensor, BucketMeta]]:
        size = sum(t.numel() for _, t in group)
        if self._meta.names and self._meta.numel + size > self.capacity:
            yield self._emit()
        meta = self._meta
        buf = self._buffer(meta.numel + size)
        for name, t in group:
            n = t.numel()
            buf[meta.numel:meta.numel + n].copy_(t.reshape(-1))
            meta.names.append(name)
            meta.shapes.append(tuple(t.shape))
            meta.offsets.append(meta.numel)
            meta.numel += n
            self.num_tensors += 1

    def _emit(self) -> tuple[torch.Tensor, BucketMeta]:
        meta = self._meta
        self._meta = BucketMeta(meta.index + 1, self.dtype_name)
        self.num_buckets += 1
        self.total_bytes += meta.nbytes
        self.max_bucket_bytes = max(self.max_bucket_bytes, meta.nbytes)
        assert self._buf is not None
        return self._buf[: meta.numel], meta
