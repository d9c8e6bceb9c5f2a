"""Full HF-named weights out of a sharded Megatron model: for the rollout engine and for export.

`iter_hf_weights` is collective over TP; each pipeline stage yields its own tensors. The ranks that
keep them are `is_hf_weight_source()` (TP rank 0, DP rank 0: one per stage), so together they cover
every tensor exactly once, whatever the layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def source_buckets(engine: Any, bucket_mb: float) -> Iterator[dict[str, torch.Tensor]]:
    """Buckets (name -> CPU tensor, about `bucket_mb` each) of this rank's share; every rank must
    iterate to the end (collective), non-source ranks get no buckets."""
    from workers.megatron.hf_weights import is_hf_weight_source

    keep = is_hf_weight_source()
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in engine.iter_hf_weights():
        if not keep:
            continue
        bucket[name] = tensor.detach().to("cpu", copy=True)
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_mb * 2**20:
            yield bucket
            bucket, size = {}, 0
    if bucket:
        yield bucket


def put_buckets(engine: Any, bucket_mb: float) -> list[Any]:
    """This rank's buckets put into the Ray object store; returns their ObjectRefs (none on non-source ranks)."""
    import ray

    return [ray.put(b) for b in source_buckets(engine, bucket_mb)]


def fetch_state_dict(refs: list[Any], timeout_s: float | None = None) -> dict[str, torch.Tensor]:
    """Merge the buckets behind `refs` (from `PolicyWorker.state_dict_for_rollout`) into one dict."""
    import ray

    out: dict[str, torch.Tensor] = {}
    for ref in refs:
        out.update(ray.get(ref, timeout=timeout_s))
    return out
