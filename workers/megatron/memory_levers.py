"""Memory levers a role sets (`recompute`, `recompute_num_layers`, `sequence_parallel`) as the megatron-core
`TransformerConfig` fields that turn them on. Each is exact: the same loss and update as without it.

- recompute "selective": the core attention (scores, softmax, dropout) is recomputed in backward instead of
  kept, which drops the s^2 attention terms (Korthikanti et al. 2022, section 5).
- recompute "full": every layer keeps only its input; the layers are recomputed in chunks of
  `recompute_num_layers` (method uniform).
- sequence_parallel (TP > 1): the norms' and dropouts' activations are split over the TP ranks along the
  sequence instead of replicated (ibid., section 4)."""

from __future__ import annotations

import importlib.util
from typing import Any

from workers.megatron.optim_config import OptimConfig

RECOMPUTE = ("none", "selective", "full")


def lever_overrides(recompute: str, recompute_num_layers: int, sequence_parallel: bool, tp: int) -> dict[str, Any]:
    """The TransformerConfig fields for these levers at tensor-parallel size `tp`."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r}: expected one of {', '.join(RECOMPUTE)}")
    if sequence_parallel and tp == 1:
        raise ValueError("sequence_parallel needs tensor parallelism (tp > 1); tp=1 has no sequence to split")
    out: dict[str, Any] = {}
    if recompute == "selective":
        out.update(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif recompute == "full":
        if recompute_num_layers < 1:
            raise ValueError(f"recompute_num_layers={recompute_num_layers}: expected an integer >= 1")
        out.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=recompute_num_layers)
    if sequence_parallel:
        out.update(sequence_parallel=True)
    return out


def cpu_offload_fields(optim: OptimConfig) -> dict[str, Any]:
    """The OptimizerConfig fields of `optim.cpu_offload` (megatron-core's HybridDeviceOptimizer: Adam's state
    and the fp32 master weights of `cpu_offload_fraction` of the parameters on the CPU, precision-aware, so
    the distributed optimizer is required). GPU only: it runs its copies on CUDA streams."""
    if not optim.cpu_offload:
        return {}
    if not optim.use_distributed_optimizer:
        raise ValueError("optim.cpu_offload needs optim.use_distributed_optimizer=true")
    if importlib.util.find_spec("transformer_engine") is None:  # megatron-core 0.16.1 fails obscurely without it
        raise ValueError("optim.cpu_offload needs transformer-engine (>= 2.1) on the workers: megatron-core's "
                         "precision-aware hybrid optimizer is built on it; install the `gpu` extra or set "
                         "optim.cpu_offload=false")
    return {"optimizer_cpu_offload": True, "optimizer_offload_fraction": float(optim.cpu_offload_fraction),
            "use_precision_aware_optimizer": True, "decoupled_weight_decay": True}


def describe(config: Any, optim: OptimConfig | None = None, cp: int = 1) -> str:
    """One line of what is on, read back from the built model's config (forced levers included), the
    context-parallel size and, for a trained model, its optimizer settings (`OptimSettings`; None when frozen)."""
    parts = [f"context parallel over cp={cp} (keys and values all-gathered)"] if cp > 1 else []
    if config.recompute_granularity == "selective":
        parts.append(f"selective recompute ({', '.join(config.recompute_modules or [])})")
    elif config.recompute_granularity == "full":
        parts.append(f"full recompute ({config.recompute_method}, {config.recompute_num_layers} layer(s) a chunk)")
    if config.sequence_parallel:
        parts.append(f"sequence parallel over tp={config.tensor_model_parallel_size}")
    if optim is not None and optim.overlap_grad_reduce:
        parts.append("gradient reduce overlapped with backward")
    if optim is not None and optim.overlap_param_gather:
        parts.append("parameter gather overlapped with forward")
    if optim is not None and optim.cpu_offload:
        parts.append(f"optimizer CPU offload ({optim.cpu_offload_fraction:g} of the parameters)")
    return "memory levers: " + (", ".join(parts) if parts else "none")
