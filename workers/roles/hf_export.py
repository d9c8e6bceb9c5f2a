"""Export a live (TP/PP/DP-sharded) `MegatronEngine` model as an HF folder, streamed tensor by tensor.

Collective over the whole world. One rank per pipeline stage (tp 0, dp 0) writes that stage's tensors
to its own safetensors file while they are gathered over TP; rank 0 then writes the index (when there
are several files), config.json, the generation config and the tokenizer files. A LoRA model exports its
merged weights (W + s B A) there, and its adapters in PEFT's format under `adapter/`
(`workers.megatron.lora_peft`), loadable onto the base model with `peft.PeftModel.from_pretrained`.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("workers")
_EXTRA_FILES = ("generation_config.json",)
ADAPTER_SUBDIR = "adapter"  # a LoRA model's PEFT adapter folder inside the export


def stage_file_name(stage: int, pp: int) -> str:
    return "model.safetensors" if pp == 1 else f"model-{stage + 1:05d}-of-{pp:05d}.safetensors"


def _write_stage(engine: Any, out: Path) -> tuple[str, list[str]] | None:
    """This rank's part: stream its stage's HF tensors into a file when it is the stage's writer."""
    from megatron.core import parallel_state as ps

    from workers.megatron.hf_map import expected_hf_shapes
    from workers.megatron.hf_weights import is_hf_weight_source, iter_hf_weights, yielded_hf_names
    from workers.megatron.safetensors_writer import StreamingSafetensorsWriter

    cfg, model = engine.hf_config, engine.module
    fname = stage_file_name(ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size())
    if not is_hf_weight_source():
        for _ in iter_hf_weights(model, cfg):  # the TP / EP gathers are collective: iterate in step
            pass
        return None
    shapes = expected_hf_shapes(cfg)
    names = yielded_hf_names(model, cfg)
    with StreamingSafetensorsWriter(out / fname, [(n, shapes[n], engine.dtype) for n in names]) as writer:
        for name, tensor in iter_hf_weights(model, cfg):
            writer.write(name, tensor.to(engine.dtype))
    return fname, names


def _write_side_files(engine: Any, out: Path, tokenizer_path: str | None) -> None:
    cfg = engine.hf_config
    cfg.torch_dtype = engine.dtype
    cfg.save_pretrained(out)
    src = Path(engine.model_path)
    for name in _EXTRA_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    if tokenizer_path:
        try:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True).save_pretrained(out)
        except Exception as e:  # noqa: BLE001 - the weights are still usable; say why the tokenizer is missing
            log.warning("export to %s: no tokenizer copied from %s (%s)", out, tokenizer_path, e)


def export_hf_folder(engine: Any, path: str | Path, tokenizer_path: str | None = None) -> Path:
    """Write the engine's full model as an HF folder at `path` (collective; see module docstring)."""
    from workers.megatron.hf_weights import write_hf_index

    out = Path(path)
    dist = torch.distributed
    rank = dist.get_rank()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        for stale in list(out.glob("*.safetensors")) + list(out.glob("model.safetensors.index.json")):
            stale.unlink()
    dist.barrier()
    part = _write_stage(engine, out)
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, part)
    if rank == 0:
        files = dict(p for p in parts if p is not None)
        if len(files) > 1:
            write_hf_index(out, files)
        _write_side_files(engine, out, tokenizer_path)
    dist.barrier()
    if engine.lora is not None:  # the merged weights above, and the adapters alone in PEFT's format
        from workers.megatron.lora_peft import write_peft_adapter

        write_peft_adapter(engine, out / ADAPTER_SUBDIR)
    return out
