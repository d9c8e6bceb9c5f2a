"""Rank functions for the LoRA engine tests (module level so spawned ranks can import them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["linear_qkv", "o_proj", "gate_proj", "up_proj", "linear_fc2"]}
OPTIM = {"lr": 2e-2, "clip_grad": 1.0, "weight_decay": 0.01, "total_steps": 100}


def lm_batch(vocab: int, rows: int = 4, width: int = 24, seed: int = 0) -> Any:
    """A fixed LM batch of random tokens (the same on every rank)."""
    from workers.batch import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, width + 1), generator=g)
    return Batch({"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.ones(rows, width),
                  "position_ids": torch.arange(width).expand(rows, width).clone()})


def _step(engine: Any, micros: list, normalizer: float) -> float:
    """One optimizer step of token-mean cross-entropy over `micros`; returns the loss (on every rank)."""
    from megatron.core import parallel_state as ps

    from workers.roles.logits import vocab_parallel_logprobs

    def loss_fn(mb: Any, logits: torch.Tensor) -> tuple[torch.Tensor, Any]:
        logp, _ = vocab_parallel_logprobs(logits, mb.fields["labels"], engine.vocab_size)
        loss = -(logp * mb.fields["loss_mask"]).sum() / normalizer * len(micros)
        return loss, loss.detach()

    engine.zero_grad()
    out = engine.forward_backward(micros, loss_fn, forward_only=False)
    engine.optimizer_step()
    total = torch.tensor([float(sum(out)) / len(micros) if out else 0.0], device=engine.device)  # NCCL: on CUDA
    torch.distributed.all_reduce(total, group=ps.get_pipeline_model_parallel_group())  # last stage has it
    return float(total.item())


def _logits(engine: Any, ids: torch.Tensor) -> torch.Tensor | None:
    from workers.megatron.model_provider import forward_logits

    out = forward_logits(engine.module, ids)
    return None if out is None else out[..., : engine.vocab_size].float()


def train_lora(model_path: str, out_dir: str, steps: int = 3, ckpt: bool = False) -> dict[str, Any]:
    """Train LoRA adapters for `steps` steps on a fixed batch; returns the losses, parameter counts, the
    merged HF weights, the unmerged model's logits and (rank 0) writes the HF export with its PEFT adapter
    to `out_dir/hf`. With `ckpt`: save after step 1, train on, load and train again (both runs' losses and
    adapters returned)."""
    from megatron.core import parallel_state as ps

    from workers.megatron.engine import MegatronEngine, _inner_optimizers
    from workers.megatron.hf_weights import is_hf_weight_source, write_hf_shards
    from workers.megatron.lora import adapter_parameters
    from workers.roles.hf_export import export_hf_folder
    from workers.roles.lm import lm_micros

    engine = MegatronEngine(model_path, optim=OPTIM, lora=LORA)
    base = {n: t.clone() for n, t in engine.iter_hf_weights()}
    inner = _inner_optimizers(engine.optimizer)
    res: dict[str, Any] = {
        "tp_rank": ps.get_tensor_model_parallel_rank(), "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "trainable": sum(p.numel() for p in engine.module.parameters() if p.requires_grad),
        "frozen_with_grad": [n for n, p in engine.module.named_parameters() if p.requires_grad and "lora_" not in n],
        "adapters": sum(p.numel() for _, p in adapter_parameters(engine.module)),
        "optimizer_params": sum(p.numel() for o in inner for g in o.param_groups for p in g["params"]),
    }
    batch = lm_batch(engine.vocab_size)
    micros = lm_micros(batch, 2, engine.device)
    norm = float(batch["loss_mask"].sum())
    ids = batch["tokens"][:2]
    res["logits_before"] = _logits(engine, ids)
    res["losses"] = [_step(engine, micros, norm)]
    if ckpt:
        engine.save_checkpoint(Path(out_dir) / "ckpt")
    res["losses"] += [_step(engine, micros, norm) for _ in range(steps - 1)]
    res["optimizer_state"] = sum(t.numel() for o in inner for s in o.state.values() for t in s.values()
                                 if isinstance(t, torch.Tensor) and t.dim() > 0)
    merged = {n: t.clone() for n, t in engine.iter_hf_weights()}  # collective: every rank iterates
    res["merged"] = merged if is_hf_weight_source() else None
    # the shared-memory sync's path: each rank writes its merged shards into full tensors (no collective)
    shapes = {n: t.shape for n, t in merged.items()}
    written = {n: torch.zeros(s) for n, s in shapes.items()}
    write_hf_shards(engine.module, engine.hf_config, lambda name: written[name])
    res["written"] = written
    res["base"] = base if is_hf_weight_source() else None
    res["logits"] = _logits(engine, ids)
    res["ids"] = ids
    export_hf_folder(engine, Path(out_dir) / "hf", model_path)
    if ckpt:
        res["adapters_trained"] = {n: p.detach().clone() for n, p in adapter_parameters(engine.module)}
        meta = engine.load_checkpoint(Path(out_dir) / "ckpt")
        res["meta_lora"] = meta.get("lora")
        res["losses_resumed"] = [_step(engine, micros, norm) for _ in range(steps - 1)]
        res["adapters_resumed"] = {n: p.detach().clone() for n, p in adapter_parameters(engine.module)}
        res["load_errors"] = load_into(model_path, str(Path(out_dir) / "ckpt"), [{**LORA, "rank": 8}, None])
    return res


def load_into(model_path: str, ckpt_dir: str, loras: list[dict[str, Any] | None]) -> list[str]:
    """Load a checkpoint into an engine with each of `loras`; returns the error messages ("" = loaded)."""
    from workers.megatron.engine import MegatronEngine

    errors = []
    for lora in loras:
        engine = MegatronEngine(model_path, optim=OPTIM, lora=lora)
        try:
            engine.load_checkpoint(ckpt_dir)
            errors.append("")
        except ValueError as e:
            errors.append(str(e))
    return errors


def train_full(model_path: str, optim: dict[str, Any], steps: int = 3) -> dict[str, Any]:
    """Full fine-tuning for `steps` steps on the fixed batch with these optimizer settings; returns the losses
    and the HF weights after them (gathered: every rank's)."""
    from workers.megatron.engine import MegatronEngine
    from workers.roles.lm import lm_micros

    engine = MegatronEngine(model_path, optim={**OPTIM, **optim})
    batch = lm_batch(engine.vocab_size)
    micros = lm_micros(batch, 2, engine.device)
    norm = float(batch["loss_mask"].sum())
    losses = [_step(engine, micros, norm) for _ in range(steps)]
    return {"losses": losses, "weights": {n: t.float().cpu().clone() for n, t in engine.iter_hf_weights()}}
