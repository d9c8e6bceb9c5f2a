"""Full HF-named weights out of a sharded Megatron model: for the rollout engine and for export.

`iter_hf_weights` is collective over TP; each pipeline stage yields its own tensors. The ranks that
keep them are `is_hf_weight_source()` (TP rank 0, DP rank 0: one per stage), so together they cover
every tensor exactly once, whatever the layout.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
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


def save_hf_folder(engine: Any, out_dir: str | Path, rank: int, max_shard_mb: float = 2048.0) -> Path:
    """Write safetensors files (one or more per pipeline stage) and, on rank 0, config.json and the
    index into `out_dir`. Collective over the whole world."""
    from megatron.core import parallel_state as ps
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stage = ps.get_pipeline_model_parallel_rank()
    for i, bucket in enumerate(source_buckets(engine, max_shard_mb)):
        save_file({k: v.contiguous() for k, v in bucket.items()}, str(out / f"model-pp{stage:02d}-{i:05d}.safetensors"),
                  metadata={"format": "pt"})
    torch.distributed.barrier()
    if rank == 0:
        weight_map = {}
        for f in sorted(out.glob("model-pp*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                weight_map.update({k: f.name for k in h.keys()})
        engine.hf_config.save_pretrained(out)
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=1) + "\n")
    torch.distributed.barrier()
    return out
