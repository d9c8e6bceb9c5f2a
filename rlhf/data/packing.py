"""Sequence packing: assigning samples to fixed-size rows, and the masks that keep packed samples apart."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch


def pack_lengths(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit-decreasing bin packing: lists of sample indices whose lengths sum to at most `capacity`.

    Deterministic (ties broken by index); within a pack, indices are in ascending order.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (remaining capacity, bin index)
    for i in order:
        n = int(lengths[i])
        if n > capacity:
            raise ValueError(f"sample {i} has length {n} > capacity {capacity}")
        pos = bisect.bisect_left(free, (n, -1))
        if pos < len(free):
            remaining, b = free.pop(pos)
        else:
            remaining, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        bisect.insort(free, (remaining - n, b))
    return [sorted(b) for b in bins]


def row_segments(segment_lengths: Sequence[int], seq_length: int) -> list[int]:
    """The row's segments with the trailing padding (if any) as one more segment; they sum to seq_length."""
    used = int(sum(segment_lengths))
    if used > seq_length:
        raise ValueError(f"segments sum to {used} > seq_length {seq_length}")
    segs = [int(s) for s in segment_lengths]
    return segs + [seq_length - used] if used < seq_length else segs


def segment_ids(rows: Sequence[Sequence[int]], seq_length: int) -> torch.Tensor:
    """[B, S] int64 segment index of every position (padding is its own last segment)."""
    out = torch.empty(len(rows), seq_length, dtype=torch.long)
    for b, segs in enumerate(rows):
        full = row_segments(segs, seq_length)
        out[b] = torch.repeat_interleave(torch.arange(len(full)), torch.tensor(full))
    return out


def block_causal_mask(rows: Sequence[Sequence[int]], seq_length: int) -> torch.Tensor:
    """[B, 1, S, S] bool, True = masked: causal within each segment, blocked across segments."""
    seg = segment_ids(rows, seq_length)
    causal = torch.ones(seq_length, seq_length, dtype=torch.bool).tril()
    allowed = causal[None] & (seg[:, :, None] == seg[:, None, :])
    return ~allowed[:, None]


def causal_mask(seq_length: int) -> torch.Tensor:
    """[1, 1, S, S] bool, True = masked: the plain causal mask."""
    return ~torch.ones(seq_length, seq_length, dtype=torch.bool).tril()[None, None]


def cu_seqlens(rows: Sequence[Sequence[int]], seq_length: int) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32 [N+1], max_seqlen) over the batch flattened to B*S tokens (THD / varlen layout),
    padding counted as its own segment so the last offset is B*S."""
    offsets = [0]
    for segs in rows:
        for n in row_segments(segs, seq_length):
            offsets.append(offsets[-1] + n)
    lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
    return torch.tensor(offsets, dtype=torch.int32), max(lengths, default=0)
