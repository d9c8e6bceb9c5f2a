"""LoRA on a live megatron-core GPT: adapters on its tensor-parallel linear layers, the base frozen.

`apply_lora(model, cfg)` (after the base weights are loaded, before DDP and the optimizer are built) freezes
every parameter and gives each targeted linear layer (`workers.megatron.lora_config`) two trainable factors,
`lora_a` and `lora_b`, so that the layer computes W x + s B A dropout(x) with s = alpha / rank. The layer's
class is swapped for a subclass (`LoRALinear` first in its MRO), so its own parameter names stay
(`linear_qkv.weight`) and the adapters sit beside them (`linear_qkv.lora_a`).

Tensor parallelism (no sequence parallelism; the GPT layers megatron builds have gather_output=False and
input_is_parallel=True):
- column-parallel (`linear_qkv`, `linear_fc1`): x is whole on every TP rank; A [r, in] is replicated and B
  [out/tp, r] split along its rows like W. The low-rank activation A x goes through
  `copy_to_tensor_model_parallel_region` (identity forward, all-reduce backward), so A and x get the gradient
  of every rank's B.
- row-parallel (`linear_proj`, `linear_fc2`): x is split along its features; A [r, in/tp] is split along its
  columns like W and B [out, r] replicated. The partial A x is summed over TP
  (`reduce_from_tensor_model_parallel_region`) before B.
The split factor carries megatron's `tensor_model_parallel` / `partition_dim` attributes, so gradient norms
and clipping count it once per shard and the replicated one once. A is initialised as PEFT does (Kaiming-
uniform over the full input) from a generator seeded by the layer's global name, then sliced, so every TP/PP
layout starts from the same adapters; B starts at zero (the model's output is unchanged at step 0).

`merged_weight()` is W + s B A for this rank's shard, the weight the layer behaves as: weight sync and HF
export (`workers.megatron.hf_weights`) use it in place of W, so every consumer of full weights sees the
trained model. Transformer Engine's fused layer-norm linears (`TELayerNormColumnParallelLinear`) normalise
their input inside; their adapter normalises it the same way (RMSNorm) first.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
import torch.nn.functional as F

from workers.megatron.lora_config import LoRAConfig

ADAPTER_NAMES = ("lora_a", "lora_b")
_CLASSES: dict[type, type] = {}


def is_adapter_key(name: str) -> bool:
    """Whether a parameter / state-dict name is a LoRA factor."""
    return name.rsplit(".", 1)[-1] in ADAPTER_NAMES


class LoRALinear(torch.nn.Module):
    """Mixin placed before a megatron (or TE) linear class: adds s B A dropout(x) to its output."""

    lora_a: torch.nn.Parameter
    lora_b: torch.nn.Parameter
    lora_column: bool
    lora_norm: bool
    lora_scale: float
    lora_dropout: float
    weight: torch.nn.Parameter

    def forward(self, input_: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(input_, *args, **kwargs)
        delta = self.lora_delta(input_)
        if isinstance(out, tuple):
            return (out[0] + delta.to(out[0].dtype), *out[1:])
        return out + delta.to(out.dtype)

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """s B A dropout(x) for this rank's part of the output (see the module docstring for TP)."""
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        if self.lora_norm:
            x = self._lora_normed(x)
        if self.lora_dropout and self.training:
            x = self._lora_dropped(x)
        low = F.linear(x.to(self.lora_a.dtype), self.lora_a)
        if self.lora_column:
            low = copy_to_tensor_model_parallel_region(low)
        else:
            low = reduce_from_tensor_model_parallel_region(low)
        return F.linear(low, self.lora_b) * self.lora_scale

    def _lora_dropped(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_column:  # x is the same on every TP rank, and so is the default generator
            return F.dropout(x, self.lora_dropout, True)
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        with get_cuda_rng_tracker().fork():  # x is this rank's shard: its own mask
            return F.dropout(x, self.lora_dropout, True)

    def _lora_normed(self, x: torch.Tensor) -> torch.Tensor:
        """The input of a TE fused layer-norm linear after its RMSNorm (what its GEMM sees)."""
        kind = getattr(self, "normalization", "RMSNorm")
        if kind != "RMSNorm":
            raise NotImplementedError(f"LoRA on a fused {kind} linear: only RMSNorm is supported")
        w = self.layer_norm_weight.float()
        if getattr(self, "zero_centered_gamma", False):
            w = w + 1
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * w).to(x.dtype)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """W + s B A for this rank's shard, in W's dtype (computed in fp32)."""
        delta = self.lora_b.float() @ self.lora_a.float()
        return (self.weight.float() + self.lora_scale * delta).to(self.weight.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> Any:
        """The base layer's entries plus the adapters, the split one sharded over TP (the base class would
        call every tensor it does not know replicated)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)  # type: ignore[misc]
        split = {"lora_b": 0} if self.lora_column else {"lora_a": 1}
        sd.update(make_sharded_tensors_for_checkpoint({n: getattr(self, n) for n in ADAPTER_NAMES}, prefix, split,
                                                      sharded_offsets))
        return sd


def _lora_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"LoRA{cls.__name__}", (LoRALinear, cls), {"__module__": __name__})
    return _CLASSES[cls]


def _parallel_mode(module: torch.nn.Module) -> tuple[bool, bool] | None:
    """(column, fused norm) of a linear layer megatron builds, None for anything else."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    if isinstance(module, ColumnParallelLinear):
        if module.gather_output or module.sequence_parallel:
            raise NotImplementedError("LoRA on a column-parallel linear with gather_output or sequence parallelism")
        return True, False
    if isinstance(module, RowParallelLinear):
        if not module.input_is_parallel or module.sequence_parallel:
            raise NotImplementedError("LoRA on a row-parallel linear without input_is_parallel or with sequence "
                                      "parallelism")
        return False, False
    name = type(module).__name__  # Transformer Engine's wrappers (GPU)
    modes = {"TELayerNormColumnParallelLinear": (True, True), "TEColumnParallelLinear": (True, False),
             "TERowParallelLinear": (False, False)}
    return modes.get(name)


def _global_name(model: torch.nn.Module, name: str) -> str:
    """`name` with the local layer index replaced by the global one (the same on every PP layout)."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "decoder" and parts[1] == "layers":
        parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
    return ".".join(parts)


def _targeted(name: str, targets: tuple[str, ...]) -> bool:
    # routed experts (`mlp.experts.`) keep their weights: their expert-parallel groups are not handled here
    return name.rsplit(".", 1)[-1] in targets and ".mlp.experts." not in f".{name}"


def linear_names(model: torch.nn.Module) -> list[str]:
    """The distinct layer names (last component) of the linear layers LoRA could adapt in `model`."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and _parallel_mode(m) is not None})


def apply_lora(model: torch.nn.Module, cfg: LoRAConfig) -> list[str]:
    """Freeze `model` and add adapters to the targeted layers (see the module docstring); returns the names of
    the adapted modules. ValueError (naming the targets and what the model has) when none matches."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    err = cfg.fit_error()
    if err:
        raise ValueError(f"lora.{err}")
    targets = cfg.targets()
    for p in model.parameters():
        p.requires_grad_(False)
    tp = ps.get_tensor_model_parallel_world_size()
    tp_rank = ps.get_tensor_model_parallel_rank()
    adapted = []
    for name, module in list(model.named_modules()):
        if not name or not _targeted(name, targets):
            continue
        mode = _parallel_mode(module)
        if mode is None:
            continue
        column, norm = mode
        weight = module.weight
        out_local, in_local = weight.shape
        in_full = in_local if column else in_local * tp
        g = torch.Generator().manual_seed(zlib.crc32(_global_name(model, name).encode()))
        bound = 1.0 / math.sqrt(in_full)  # kaiming_uniform_(a=sqrt(5)), as PEFT and nn.Linear initialise
        a_full = torch.empty(cfg.rank, in_full).uniform_(-bound, bound, generator=g)
        a = a_full if column else a_full[:, tp_rank * in_local:(tp_rank + 1) * in_local]
        b = torch.zeros(out_local, cfg.rank)
        module.__class__ = _lora_class(type(module))
        module.lora_a = torch.nn.Parameter(a.to(weight.device, weight.dtype).contiguous())
        module.lora_b = torch.nn.Parameter(b.to(weight.device, weight.dtype))
        split = module.lora_b if column else module.lora_a
        set_tensor_model_parallel_attributes(split, True, 0 if column else 1, 1)
        for p in (module.lora_a, module.lora_b):
            p.lora_adapter = True  # type: ignore[attr-defined]  # hf_map.bind skips it
        module.lora_column, module.lora_norm = column, norm
        module.lora_scale, module.lora_dropout = cfg.scale, cfg.dropout
        adapted.append(name)
    if not adapted:
        raise ValueError(f"lora.target_modules {list(cfg.target_modules)} matched no layer of the model; its "
                         f"linear layers: {', '.join(linear_names(model))}")
    return adapted


def adapted_layers(model: torch.nn.Module) -> dict[int, LoRALinear]:
    """id(base weight) -> its adapted layer, for every LoRA layer of `model` ({} without LoRA)."""
    return {id(m.weight): m for m in model.modules() if isinstance(m, LoRALinear)}


def adapter_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every LoRA factor of `model`, in module order."""
    return [(n, p) for n, p in model.named_parameters() if is_adapter_key(n)]
