"""Move weights between a live (TP/PP-sharded) megatron GPTModel and HF-named full tensors.

- `load_hf_weights(model, source, hf_config)`: fill this rank's shards from HF tensors, read one at a
  time (safetensors via `safe_open`, or an in-memory state dict). Not collective.
- `iter_hf_weights(model, hf_config)`: yield (hf_name, full tensor). Collective over the TP group (one
  all-gather per parameter) and, for routed experts, over the expert-parallel group (every EP rank
  yields every expert): every rank of the TP group must iterate to the end, in step.
  What each rank yields: the full HF tensors of ITS OWN pipeline stage (global layer indices; the
  embedding on the first stage, `model.norm` and `lm_head` / `score` on the last), identical on all
  ranks of a TP group and on all DP replicas. Consumers usually keep the output of the ranks where
  `is_hf_weight_source()` holds (tp rank 0, dp rank 0: one per PP stage); together these cover every
  HF tensor exactly once. Vocab padding is removed; a tied output layer is not yielded. A LoRA layer
  (`workers.megatron.lora`) yields its merged weight W + s B A: each shard is merged locally first.
- `write_hf_shards(model, hf_config, target)`: the same result without any collective: this rank copies
  its own TP shard of every parameter into its rows / columns of the full HF tensors `target(name)`
  returns (e.g. views of a shared-memory file). When every rank of one DP replica writes its dense
  parameters and every rank of expert-data-parallel rank 0 its routed experts (`shard_writers`), the
  targets hold the full model: with EP > 1 one DP replica holds only its EP rank's experts.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from workers.file_problems import FileProblem, file_errors
from workers.megatron.dist_setup import tp_layout
from workers.megatron.hf_map import (
    REPLICATED,
    Binding,
    Dims,
    bind,
    check_hf_tensors,
    ep_layout,
    expert_hf_names,
    shard_into_hf,
    to_hf,
    to_mcore_shard,
    tp_concat_dim,
)
from workers.megatron.lora import LoRALinear, adapted_layers
from workers.megatron.value_head import ValueHead


class HFTensorSource:
    """HF tensors read one at a time from a folder of safetensors files (lazily, with `safe_open`) or
    from an in-memory mapping name -> tensor."""

    def __init__(self, source: str | Path | Mapping[str, torch.Tensor]) -> None:
        self._stack = contextlib.ExitStack()
        self._mapping: Mapping[str, torch.Tensor] | None = None
        self._handles: dict[str, Any] = {}
        if isinstance(source, Mapping):
            self._mapping = source
            return
        from safetensors import SafetensorError, safe_open

        folder = Path(source)
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {folder}")
        for f in files:
            try:
                with file_errors(f, "read"):
                    handle = self._stack.enter_context(safe_open(str(f), framework="pt"))
            except SafetensorError as e:  # a header that does not parse or covers more bytes than the file has
                self._stack.close()
                raise FileProblem(f, f"truncated or corrupt safetensors file ({e})") from e
            for name in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                if name in self._handles:
                    raise ValueError(f"tensor {name} appears in more than one safetensors file ({f.name})")
                self._handles[name] = handle

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor, without reading data."""
        if self._mapping is not None:
            return {k: tuple(v.shape) for k, v in self._mapping.items()}
        return {k: tuple(h.get_slice(k).get_shape()) for k, h in self._handles.items()}

    def dtypes(self) -> dict[str, str]:
        """Name -> dtype name ('F32', 'BF16', ...) in safetensors notation."""
        if self._mapping is not None:
            return {k: str(v.dtype) for k, v in self._mapping.items()}
        return {k: h.get_slice(k).get_dtype() for k, h in self._handles.items()}

    def get(self, name: str) -> torch.Tensor:
        """The full tensor `name` (a fresh copy for safetensors)."""
        if self._mapping is not None:
            return self._mapping[name]
        return self._handles[name].get_tensor(name)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> HFTensorSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_value_model(model: torch.nn.Module) -> bool:
    return isinstance(getattr(model, "output_layer", None), ValueHead)


def load_hf_weights(
    model: torch.nn.Module,
    source: str | Path | Mapping[str, torch.Tensor] | HFTensorSource,
    hf_config: Any,
    check: bool = True,
) -> list[str]:
    """Fill the current TP/PP rank's shard of every parameter of `model` from HF tensors.

    `source` is a HF model folder (safetensors), a state dict, or an `HFTensorSource`. With `check`,
    first verifies the source against the config (every tensor present once with the right shape, none
    extra). Raises ValueError naming the tensor or parameter on any mismatch. Returns the megatron
    parameter names filled: all of them, except for a value model (critic / reward model) loaded from a
    causal-LM checkpoint without `score.weight`, whose value head keeps its initial weights (the LM head
    is dropped).
    """
    src = source if isinstance(source, HFTensorSource) else HFTensorSource(source)
    try:
        shapes = src.shapes()
        value_model = _is_value_model(model)
        # A value model loaded from a causal-LM checkpoint (no `score.weight`): drop the LM head and keep
        # the value head's initial weights.
        from_lm = value_model and "score.weight" not in shapes
        if check:
            check_hf_tensors(hf_config, shapes, value_head=value_model and not from_lm)
        d = Dims.from_hf(hf_config)
        tp_rank, tp, _ = tp_layout()
        filled = []
        for b in bind(model, hf_config):
            if from_lm and b.hf_names == ("score.weight",):
                continue
            hf = [src.get(n) for n in b.hf_names]
            padded = b.param.shape[0] * tp
            shard = to_mcore_shard(b.kind, hf, d, tp_rank, tp, padded)
            if tuple(shard.shape) != tuple(b.param.shape):
                raise ValueError(
                    f"megatron parameter {b.mcore_name} has shape {list(b.param.shape)} but HF "
                    f"{', '.join(b.hf_names)} give {list(shard.shape)} on tp rank {tp_rank}"
                )
            with torch.no_grad():
                b.param.copy_(shard)
            filled.append(b.mcore_name)
            del hf, shard
        return filled
    finally:
        if src is not source:
            src.close()


def iter_hf_weights(
    model: torch.nn.Module, hf_config: Any, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for this rank's pipeline stage, gathering TP shards (collective over
    the TP group; see the module docstring for which ranks yield what). `dtype` casts the output."""
    d = Dims.from_hf(hf_config)
    _, tp, group = tp_layout()
    _, ep, ep_group = ep_layout()
    lora = adapted_layers(model)
    for b in bind(model, hf_config):
        if b.alias:
            continue
        local = _local_weight(b, lora)
        if tp > 1 and tp_concat_dim(b.kind) is not None:
            shards = [torch.empty_like(local) for _ in range(tp)]
            torch.distributed.all_gather(shards, local.contiguous(), group=group)
        else:
            shards = [local]
        full = to_hf(b.kind, shards, d)
        if b.expert and ep > 1:  # the same local expert of every EP rank: each rank yields all experts
            for i, tensor in enumerate(full):
                parts = [torch.empty_like(tensor) for _ in range(ep)]
                torch.distributed.all_gather(parts, tensor.contiguous(), group=ep_group)
                for r, part in enumerate(parts):
                    yield expert_hf_names(b, r)[i], part if dtype is None else part.to(dtype)
            continue
        for name, tensor in zip(b.hf_names, full):
            yield name, tensor if dtype is None else tensor.to(dtype)


def _local_weight(b: Binding, lora: Mapping[int, LoRALinear]) -> torch.Tensor:
    """This rank's shard of `b` as the model computes with it: W, or W + s B A for a LoRA layer."""
    layer = lora.get(id(b.param))
    return b.param.detach() if layer is None else layer.merged_weight()


def yielded_hf_names(model: torch.nn.Module, hf_config: Any) -> list[str]:
    """The HF names `iter_hf_weights` yields on this rank (this stage's tensors, every expert), in order."""
    _, ep, _ = ep_layout()
    names: list[str] = []
    for b in bind(model, hf_config):
        if b.alias:
            continue
        if b.expert and ep > 1:
            names += [expert_hf_names(b, r)[i] for i in range(len(b.hf_names)) for r in range(ep)]
        else:
            names += b.hf_names
    return names


def write_hf_shards(model: torch.nn.Module, hf_config: Any, target: Callable[[str], torch.Tensor],
                    dense: bool = True, experts: bool = True) -> dict[str, int]:
    """Copy this rank's TP shard of every parameter into its part of the full HF tensors `target(name)`
    (not collective; see the module docstring). `dense`: the parameters outside the routed experts;
    `experts`: this EP rank's routed experts, under their global expert index (`shard_writers` says which
    a rank writes). Replicated tensors are written by TP rank 0 only; a tied output layer is skipped.
    Returns {"tensors": parameters written, "bytes": bytes written}."""
    d = Dims.from_hf(hf_config)
    tp_rank, tp, _ = tp_layout()
    etp_rank, etp = expert_tp_layout()
    lora = adapted_layers(model)
    n = nbytes = 0
    for b in bind(model, hf_config):
        if b.alias or not (experts if b.expert else dense):
            continue
        rank, size = (etp_rank, etp) if b.expert else (tp_rank, tp)
        if b.kind == REPLICATED and rank != 0:
            continue
        out = [target(name) for name in b.hf_names]
        nbytes += shard_into_hf(b.kind, _local_weight(b, lora), out, d, rank, size) * out[0].element_size()
        n += 1
    return {"tensors": n, "bytes": nbytes}


def shard_writers() -> tuple[bool, bool]:
    """(dense, experts): what this rank writes with `write_hf_shards` so that the ranks together write every
    tensor once: the dense parameters on DP (and context-parallel) replica 0, the routed experts on expert-data-parallel rank 0
    (with EP > 1 these are EP ranks 0..ep-1, each holding its own experts; with EP 1 the same ranks as dense)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return True, True
    return ps.get_data_parallel_rank(with_context_parallel=True) == 0, ps.get_expert_data_parallel_rank() == 0


def expert_tp_layout() -> tuple[int, int]:
    """(rank, size) of this rank's expert tensor-parallel group ((0, 1) without megatron state)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1
    return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()


def is_hf_weight_source() -> bool:
    """True on the ranks whose `iter_hf_weights` output a consumer should keep: tp rank 0 and dp rank 0
    (one rank per pipeline stage) and context-parallel rank 0."""
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank() == 0 and \
        parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0


def hf_index(files: Mapping[str, list[str]]) -> dict:
    """A `model.safetensors.index.json` body mapping each tensor name to its file."""
    weight_map = {name: fname for fname, names in files.items() for name in names}
    return {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}


def write_hf_index(folder: str | Path, files: Mapping[str, list[str]]) -> Path:
    """Write `model.safetensors.index.json` into `folder`."""
    path = Path(folder) / "model.safetensors.index.json"
    path.write_text(json.dumps(hf_index(files), indent=2) + "\n")
    return path
