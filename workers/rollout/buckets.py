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

from workers.dtypes import as_dtype


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
        return self.numel * as_dtype(self.dtype).itemsize


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

    Buckets are packed into `num_buffers` buffers in turn, so a bucket stays valid while the next
    `num_buffers - 1` are packed (with 2, a transport can send one asynchronously while the next is
    gathered). `buckets()` yields (buffer view, meta). Buffers handed in (`buffers`, from an earlier
    sync) are reused: a fresh buffer costs page faults as dear as the copy itself.
    """

    def __init__(self, bucket_bytes: int, dtype: str | torch.dtype, device: str | torch.device = "cpu",
                 buffers: list[torch.Tensor] | None = None, num_buffers: int = 1) -> None:
        self.dtype = as_dtype(dtype)
        self.dtype_name = str(self.dtype).replace("torch.", "")
        self.capacity = max(1, int(bucket_bytes) // self.dtype.itemsize)
        self.device = torch.device(device)
        old = [b for b in (buffers or []) if b.dtype == self.dtype and b.device.type == self.device.type]
        self._bufs: list[torch.Tensor | None] = (old + [None] * num_buffers)[:num_buffers]
        self._cur = 0
        self.num_buckets = 0
        self.num_tensors = 0
        self.total_bytes = 0
        self.max_bucket_bytes = 0

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The packing buffers (hand them to the next packer to reuse them)."""
        return [b for b in self._bufs if b is not None]

    def _buffer(self, numel: int) -> torch.Tensor:
        need = max(numel, self.capacity)
        buf = self._bufs[self._cur]
        if buf is None or buf.numel() < need:
            buf = self._bufs[self._cur] = torch.empty(need, dtype=self.dtype, device=self.device)
        return buf

    def buckets(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[torch.Tensor, BucketMeta]]:
        """Consume `weights` and yield full buckets in order."""
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
        buf = self._bufs[self._cur]
        assert buf is not None
        self._cur = (self._cur + 1) % len(self._bufs)
        return buf[: meta.numel], meta


class BufferPool:
    """Receive buffers reused across buckets and syncs, never while a view handed out from them is alive.

    vLLM may hold views of a bucket until its module is complete (or until the end of the reload, for a
    vocab-padded embedding), so a buffer is reused only when every view yielded from it has been freed
    (tracked with weak references); otherwise a new one is allocated.
    """

    def __init__(self, max_buffers: int = 3) -> None:
        self.max_buffers = max_buffers
        self._pool: list[tuple[torch.Tensor, list]] = []

    def get(self, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        device = torch.device(device)
        for i, (buf, refs) in enumerate(self._pool):
            if (buf.numel() >= numel and buf.dtype == dtype and buf.device == device
                    and all(r() is None for r in refs)):
                refs.clear()
                self._pool.append(self._pool.pop(i))
                return buf[:numel]
        buf = torch.empty(numel, dtype=dtype, device=device)
        self._pool.append((buf, []))
        if len(self._pool) > self.max_buffers:
            self._pool.pop(0)
        return buf

    def views(self, buf: torch.Tensor, meta: BucketMeta) -> Iterator[tuple[str, torch.Tensor]]:
        """`unpack(buf, meta)`, remembering each view so the buffer is not reused while one lives."""
        import weakref

        refs = next((r for b, r in self._pool if b.data_ptr() == buf.data_ptr()), None)
        for name, view in unpack(buf, meta):
            if refs is not None:
                refs.append(weakref.ref(view))
            yield name, view
