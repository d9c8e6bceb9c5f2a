"""Sequence packing: assigning samples to fixed-size rows and laying out each row's segments."""

from __future__ import annotations

import bisect
from collections.abc import Sequence


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
