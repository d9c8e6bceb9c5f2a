"""The LoRA adapters of a live (TP/PP/DP-sharded) megatron model as a PEFT adapter folder.

`write_peft_adapter(engine, out)` (collective over the whole world) writes `adapter_config.json` and
`adapter_model.safetensors` that `peft.PeftModel.from_pretrained(hf_base_model, out)` loads onto the base
model (the engine's `model_path`). PEFT keeps one adapter pair per HF projection where megatron fuses
several into one layer: the fused layer's A is repeated for each of its projections and B's rows are split
into theirs (`linear_qkv` -> `q_proj`, `k_proj`, `v_proj`; `linear_fc1` -> `gate_proj`, `up_proj`), with the
same layouts as the base weights (`workers.megatron.hf_map.to_hf`), so PEFT computes the same update.
`target_modules` lists the adapted HF modules by full name.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from workers.megatron.dist_setup import tp_layout
from workers.megatron.hf_map import ROW, Dims, bind, to_hf
from workers.megatron.lora import adapted_layers

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."  # PEFT's name of the wrapped HF model


def _gather(t: torch.Tensor, tp: int, group: Any) -> list[torch.Tensor]:
    if tp == 1:
        return [t]
    shards = [torch.empty_like(t) for _ in range(tp)]
    torch.distributed.all_gather(shards, t.contiguous(), group=group)
    return shards


def iter_peft_tensors(model: torch.nn.Module, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT name, full tensor) of this pipeline stage's adapters; collective over the TP group (every TP
    rank iterates to the end). Names: `base_model.model.<hf module>.lora_A.weight` [r, in] and `.lora_B.weight`
    [out, r]."""
    d = Dims.from_hf(hf_config)
    _, tp, group = tp_layout()
    layers = adapted_layers(model)
    for b in bind(model, hf_config):
        layer = layers.get(id(b.param))
        if layer is None:
            continue
        a, b_local = layer.lora_a.detach(), layer.lora_b.detach()
        if layer.lora_column:  # B split like W (qkv groups, gate/up halves), A the same for each projection
            b_full = to_hf(b.kind, _gather(b_local, tp, group), d)
            a_full = [a] * len(b.hf_names)
        else:  # row-parallel: A split along its input columns, B replicated
            a_full = to_hf(ROW, _gather(a, tp, group), d)
            b_full = [b_local]
        for name, a_one, b_one in zip(b.hf_names, a_full, b_full):
            module = name.removesuffix(".weight")
            yield f"{_PREFIX}{module}.lora_A.weight", a_one.contiguous()
            yield f"{_PREFIX}{module}.lora_B.weight", b_one.contiguous()


def peft_config(lora: Any, base_model: str, modules: list[str]) -> dict[str, Any]:
    """The `adapter_config.json` body for a `LoRAConfig` whose adapted HF modules are `modules`."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": sorted(modules),
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "use_rslora": False, "use_dora": False, "modules_to_save": None,
    }


def gather_peft_adapter(engine: Any) -> dict[str, Any] | None:
    """The engine's adapters in PEFT's names and config: {"tensors": name -> CPU tensor, "config": the
    adapter_config.json body} on global rank 0, None elsewhere. Collective over the whole world (the adapters
    are small: every stage's source rank sends its own to rank 0)."""
    from workers.megatron.hf_weights import is_hf_weight_source

    if engine.lora is None:
        raise ValueError("the model has no LoRA adapters to export")
    engine.finish_param_gather()
    local = {n: t.to("cpu", engine.dtype, copy=True) for n, t in iter_peft_tensors(engine.module, engine.hf_config)}
    parts: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, local if is_hf_weight_source() else None)
    if torch.distributed.get_rank() != 0:
        return None
    tensors = {k: v for p in parts if p for k, v in p.items()}
    modules = sorted({k[len(_PREFIX):].rsplit(".lora_", 1)[0] for k in tensors})
    return {"tensors": tensors, "config": peft_config(engine.lora, str(engine.model_path), modules)}


def write_peft_folder(adapter: dict[str, Any], out: str | Path) -> Path:
    """Write a `gather_peft_adapter` result as a PEFT adapter folder (not collective)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(adapter["tensors"], str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(adapter["config"], indent=2) + "\n")
    return out


def write_peft_adapter(engine: Any, out: str | Path) -> Path:
    """Write the engine's adapters as a PEFT folder at `out` (collective over the whole world; rank 0 writes)."""
    adapter = gather_peft_adapter(engine)
    if adapter is not None:
        write_peft_folder(adapter, out)
    torch.distributed.barrier()
    return Path(out)
