"""`MegatronEngine`: one rank's share of a megatron-core model with its optimizer, schedule and checkpoints.

The roles (policy, reference, critic, reward model) are thin layers over it. It assumes the world and
megatron parallel_state are up (`workers.megatron.dist_setup.init_distributed`). What it does:

- builds the local TP/PP shard of a GPT (LM or value head) from a HF folder and loads its weights;
- trainable: wraps it in Megatron DDP, builds `get_megatron_optimizer` (distributed optimizer when
  configured) and an `OptimizerParamScheduler` (warmup, then constant / linear / cosine to min lr);
- `forward_backward(micro_batches, loss_fn, forward_only)`: the pipeline schedule over micro-batches;
  `loss_fn(micro, output)` returns (loss, data) and runs on the last PP stage only;
- `optimizer_step()`: NaN/Inf check of the global grad norm (skips the step), clipping, step, lr update;
- `save_checkpoint` / `load_checkpoint` through dist_checkpointing (model, optimizer, scheduler, RNG);
  the model loads at any TP/PP/DP, the distributed optimizer state at another DP (`dp_reshardable`);
- `offload()` / `onload()`: parameters to CPU and back between uses (GPU only; no-ops on CPU).
- MoE models: the role's `MoEConfig` (router losses, dispatcher) as TransformerConfig overrides, and
  after a training pass `moe_metrics()` (router losses and expert load, `workers.megatron.moe_metrics`);
  routing replay (`workers.megatron.routing_replay`): a micro-batch's `routes` are the experts its
  tokens use, and `forward_backward(record_routes=True)` keeps the experts every token used.
- LoRA (`lora`, a `LoRAConfig`): adapters on the targeted linear layers and the rest frozen
  (`workers.megatron.lora`), so gradients, DDP buffers and optimizer state exist for the adapters only;
  checkpoints hold the adapters (their optimizer state, the LoRA settings and the base model's path),
  the base comes from `model_path` again on load; full weights (`iter_hf_weights`) are merged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from workers.config import build
from workers.dtypes import as_dtype
from workers.megatron import rope_positions
from workers.megatron.ckpt_manifest import check_saved_files, write_manifest
from workers.megatron.cpu_compat import cuda_absent
from workers.megatron.ep_align import Aligned, align_micros, round_columns
from workers.megatron.hf_fields import cfg_get
from workers.megatron.hf_weights import HFTensorSource
from workers.megatron.lora_config import LoRAConfig
from workers.megatron.masks import follow_mask
from workers.megatron.memory_levers import cpu_offload_fields, lever_overrides
from workers.megatron.micro_batch import Micro
from workers.megatron.moe_config import MoEConfig
from workers.megatron.optim_config import OptimSettings

log = logging.getLogger("workers")
_DIST_OPT_META = {"distrib_optim_sharding_type": "dp_reshardable"}


class MegatronEngine:
    """The local shard of one megatron GPT, optionally trainable (see module docstring)."""

    def __init__(
        self,
        model_path: str,
        dtype: str | torch.dtype = "float32",
        value_head: bool = False,
        trainable: bool = True,
        optim: OptimSettings | dict[str, Any] | None = None,
        load_weights: bool = True,
        recompute: str = "none",
        recompute_num_layers: int = 1,
        sequence_parallel: bool = False,
        moe: MoEConfig | dict[str, Any] | None = None,
        lora: LoRAConfig | dict[str, Any] | None = None,
        freeze_vision: bool = False,
    ) -> None:
        from megatron.core import parallel_state as ps

        from workers.megatron.hf_fields import load_model_config
        from workers.megatron.hf_map import family_of
        from workers.megatron.model_provider import build_gpt_model

        self.model_path = model_path
        self.hf_config = load_model_config(model_path)
        self.vocab_size = int(cfg_get(self.hf_config, "vocab_size"))
        self.dtype = as_dtype(dtype)
        self.value_head = value_head
        self.trainable = trainable
        self.device = torch.device("cpu") if cuda_absent() else torch.device("cuda", torch.cuda.current_device())
        self.tp = ps.get_tensor_model_parallel_world_size()
        overrides = lever_overrides(recompute, recompute_num_layers, sequence_parallel, self.tp)
        pp = ps.get_pipeline_model_parallel_world_size()
        if pp > 1:
            # micro-batches may differ in size and length (the MoE-only dispatcher check needs alltoall)
            overrides.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
        self.moe = build(MoEConfig, moe) if family_of(self.hf_config).moe else None
        if self.moe is not None:
            overrides.update(self.moe.transformer_overrides(pp))
            if self.tp > 1:  # megatron trains MoE layers at TP > 1 only with sequence parallelism
                overrides.update(sequence_parallel=True)
        if family_of(self.hf_config).vision:
            overrides["freeze_vision"] = freeze_vision
        model = build_gpt_model(self.hf_config, dtype=self.dtype, value_head=value_head, **overrides)
        model.to(self.device)
        if load_weights:
            self._load_hf(model, model_path)
        self.lora = None if lora is None else build(LoRAConfig, lora)
        if self.lora is not None:
            if not trainable:
                raise ValueError("LoRA adapters are for a trained model; this engine is frozen")
            from workers.megatron.lora import apply_lora

            apply_lora(model, self.lora)  # freezes the base: DDP and the optimizer see the adapters only
        self.module = model
        self.config = model.config
        self.supports_explicit_positions = rope_positions.install(model)
        self.cp = ps.get_context_parallel_world_size()
        if self.cp > 1:
            _check_context_parallel(self.cp, pp, self.moe is not None, self.config, self.supports_explicit_positions)
        self.expert_parallel = self.moe is not None and ps.get_expert_model_parallel_world_size() > 1
        self.routing = None
        if self.moe is not None:
            from workers.megatron import routing_replay

            if recompute == "full" and pp > 1 and self.moe.routing_replay:
                raise ValueError("routing replay with full activation recompute and pipeline parallelism: the "
                                 "1F1B schedule recomputes a micro-batch after later ones were set; use one")
            self.routing = routing_replay.install(model, self.config, self.device)
        self.recorded_routes: list[torch.Tensor] = []
        self.expert_load = None
        if self.moe is not None and trainable:
            from workers.megatron.moe_metrics import ExpertLoad

            self.expert_load = ExpertLoad(model, self.config, self.moe)
        self.optim = build(OptimSettings, optim)
        self.optimizer = None
        self.scheduler = None
        self.steps = 0
        if trainable:
            self._setup_training()
        else:
            for p in model.parameters():
                p.requires_grad_(False)
            model.eval()
            self.chunks = [model]
        self._offloaded = False

    # ---- building -----------------------------------------------------------------------------
    def _load_hf(self, model: torch.nn.Module, path: str) -> None:
        from workers.megatron.hf_weights import load_hf_weights

        src = HFTensorSource(path)
        try:
            if self.value_head:
                src = _ValueHeadSource(src, int(cfg_get(self.hf_config, "hidden_size")))
            load_hf_weights(model, src, self.hf_config)
        finally:
            src.close()

    def _setup_training(self) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o = self.optim
        if self.moe is not None:
            _mark_expert_params(self.module)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=o.overlap_grad_reduce,
            overlap_param_gather=o.overlap_param_gather, use_distributed_optimizer=o.use_distributed_optimizer,
        )
        ddp = DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=self.module)
        self.chunks = [ddp]
        opt_config = OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0],
            adam_beta2=o.betas[1], adam_eps=o.eps, clip_grad=o.clip_grad, bf16=self.dtype == torch.bfloat16,
            fp16=self.dtype == torch.float16, params_dtype=self.dtype,
            use_distributed_optimizer=o.use_distributed_optimizer, **cpu_offload_fields(o),
        )
        self.optimizer = get_megatron_optimizer(opt_config, self.chunks)
        decay_steps = max(1, o.total_steps - o.warmup_steps) if o.lr_decay_style != "constant" else max(1, o.total_steps)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if o.warmup_steps else o.lr, max_lr=o.lr, min_lr=o.min_lr,
            lr_warmup_steps=o.warmup_steps, lr_decay_steps=decay_steps + o.warmup_steps,
            lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=max(1, o.total_steps), wd_incr_style="constant",
            # on resume the config sets the schedule (lr, warmup, decay); the checkpoint gives only its step
            override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False,
        )
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = ddp.no_sync
        if self.dtype == torch.float16:
            self.config.grad_scale_func = self.optimizer.scale_loss

    # ---- layout -------------------------------------------------------------------------------
    @property
    def is_last_stage(self) -> bool:
        from megatron.core import parallel_state as ps

        return ps.is_pipeline_last_stage()

    @staticmethod
    def dp_group() -> Any:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

    @staticmethod
    def dp_size() -> int:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_world_size()

    # ---- running ------------------------------------------------------------------------------
    def forward_backward(
        self,
        micro_batches: list[Micro],
        loss_fn: Callable[[Micro, torch.Tensor], tuple[torch.Tensor, Any]],
        forward_only: bool,
        record_routes: bool = False,
    ) -> list[Any]:
        """Run the pipeline schedule; returns the `data` of `loss_fn` per micro-batch on the last stage
        ([] on other stages). Gradients accumulate over the micro-batches; the schedule divides each
        returned loss by the number of micro-batches (scale it back up if the loss is already a sum).
        With expert parallelism the ranks of an EP group run aligned micro-batches (`ep_align`); the
        results, gradients and router losses are those of this rank's own micro-batches.

        MoE models: a micro-batch's `routes` are replayed; with `record_routes`, `recorded_routes` holds
        afterwards the experts every token of each micro-batch used ([b, s, L, k] int16, every layer's,
        gathered over the pipeline stages; on every rank)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        runs = self._aligned(micro_batches)
        if not runs:
            return []

        def step(data_iter: Iterator[Aligned], model: torch.nn.Module):
            run = next(data_iter)
            mb = run.micro
            if mb.explicit_positions and not self.supports_explicit_positions:
                raise RuntimeError("this model's RoPE cannot take explicit positions (fused RoPE); "
                                   "use pack_sequences=True instead of 'prefix'")
            follow_mask(model, mb.attention_mask)
            extra = {} if run.padding is None else {"padding_mask": run.padding}
            extra.update(mb.model_inputs)
            if self.routing is not None:
                self.routing.set(mb.routes)
            ids, positions, mask = mb.input_ids, mb.position_ids, mb.attention_mask
            explicit = mb.explicit_positions
            if self.cp > 1:  # this rank's columns; RoPE at their positions, attention rows of their queries
                ids, positions, mask, extra = self._cp_local(ids, positions, mask, extra)
                explicit = True
            with rope_positions.explicit_positions(positions if explicit else None), self._router_losses(run):
                out = model(input_ids=ids, position_ids=positions, attention_mask=mask, **extra)
            if self.cp > 1:
                out = self._cp_whole(out)
            if record_routes and self.routing is not None and not run.filler:
                b, s = mb.input_ids.shape[:2]
                recorded.append(self.routing.recorded(b, s)[: run.rows, : run.cols])
            if run.filler:
                return out, lambda output: (output.sum() * 0.0, None)
            if run.padding is None:
                return out, lambda output: loss_fn(mb, output)
            return out, lambda output: loss_fn(mb, output[: run.rows, : run.cols])

        for chunk in self.chunks:
            chunk.train(not forward_only)
        if self.expert_load is not None and not forward_only:
            self.expert_load.reset()
        real = len(micro_batches)
        recorded: list[torch.Tensor] = []
        grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
        with grad_ctx, self._grads_scaled(len(runs) / max(real, 1)):
            out = get_forward_backward_func()(
                forward_step_func=step,
                data_iterator=iter(runs),
                model=self.chunks,
                num_microbatches=len(runs),
                seq_length=max(r.micro.input_ids.shape[1] for r in runs),
                micro_batch_size=max(r.micro.input_ids.shape[0] for r in runs),
                forward_only=forward_only,
            )
        if self.routing is not None:
            self.routing.clear()
            self.recorded_routes = self._gather_stages(recorded) if record_routes else []
        return list(out)[:real] if self.is_last_stage else []

    def _gather_stages(self, recorded: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every layer's routes on every stage: each stage holds -1 outside its own layers (MAX over PP)."""
        from megatron.core import parallel_state as ps

        if ps.get_pipeline_model_parallel_world_size() == 1 or not recorded:
            return recorded
        flat = torch.cat([r.flatten() for r in recorded]).to(self.device, torch.int32)
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX,
                                     group=ps.get_pipeline_model_parallel_group())
        out, o = [], 0
        for r in recorded:
            out.append(flat[o:o + r.numel()].view(r.shape).to("cpu", torch.int16))
            o += r.numel()
        return out

    def _aligned(self, micro_batches: list[Micro]) -> list[Aligned]:
        """The micro-batches as this rank runs them: as they are, or aligned with the EP group's; with sequence
        parallelism (MoE at TP > 1) their columns padded to a multiple of TP."""
        if not self.expert_parallel:
            runs = [Aligned(m, *m.input_ids.shape[:2]) for m in micro_batches]
        else:
            from megatron.core import parallel_state as ps

            runs = align_micros(micro_batches, ps.get_expert_model_parallel_group(), self.device)
        multiple = (self.tp if self.config.sequence_parallel else 1) * (2 * self.cp if self.cp > 1 else 1)
        if multiple > 1:
            runs = [round_columns(r, multiple) for r in runs]
        return runs

    # ---- context parallelism (workers.megatron.context_parallel) ----------------------------------
    def _cp_local(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                  extra: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """This context-parallel rank's columns of a micro-batch: its tokens and positions, the mask rows of
        its queries over every key column, its part of the padding mask."""
        from megatron.core import parallel_state as ps

        from workers.megatron.context_parallel import local_columns

        cols = local_columns(ids.shape[1], self.cp, ps.get_context_parallel_rank(), ids.device)
        local_extra = {k: v[:, cols] for k, v in extra.items()}
        return ids[:, cols], positions[:, cols], mask[:, :, cols, :], local_extra

    def _cp_whole(self, out: torch.Tensor) -> torch.Tensor:
        """The model output [b, s/cp, ...] of every context-parallel rank as whole rows [b, s, ...]."""
        from megatron.core import parallel_state as ps

        from workers.megatron.context_parallel import gather_sequence

        return gather_sequence(out, 1, ps.get_context_parallel_group())

    @contextlib.contextmanager
    def _grads_scaled(self, factor: float) -> Iterator[None]:
        """Gradients (of the loss and of the router losses) times `factor` for the duration: the schedule
        divides by the number of micro-batches it runs, which EP filler micro-batches may raise."""
        if factor == 1.0:
            yield
            return
        inner = self.config.grad_scale_func
        self.config.grad_scale_func = (lambda t: inner(t) * factor) if inner else (lambda t: t * factor)
        try:
            yield
        finally:
            self.config.grad_scale_func = inner

    @contextlib.contextmanager
    def _router_losses(self, run: Aligned) -> Iterator[None]:
        """The router losses of one micro-batch's forward: none, and no expert-load counts, for an EP filler;
        under sequence parallelism with padding, the z-loss coefficient of this TP rank weighted by its share
        of the real tokens. megatron-core 0.16.1 averages the z-loss over each TP rank's slice of the sequence
        (coefficient / TP each), which weights the tokens unequally when padding leaves the slices with
        different numbers of real tokens; coefficient x TP x (this slice's real tokens / the micro-batch's)
        makes the sum over the ranks the micro-batch's mean, as without TP."""
        c = self.config
        saved = c.moe_aux_loss_coeff, c.moe_z_loss_coeff
        if run.filler:
            c.moe_aux_loss_coeff, c.moe_z_loss_coeff = 0.0, None
            if self.expert_load is not None:
                self.expert_load.paused = True
        elif c.moe_z_loss_coeff and c.sequence_parallel and run.padding is not None:
            from megatron.core import parallel_state as ps

            real = ~run.padding.transpose(0, 1)  # [s, b], the sequence split over the TP ranks
            chunk = real.shape[0] // self.tp
            mine = real[ps.get_tensor_model_parallel_rank() * chunk:][:chunk]
            # a slice of padding only has a z-loss of 0 at any coefficient (not 0: megatron divides by it)
            share = max(float(mine.sum()), 1.0) / max(float(real.sum()), 1.0)
            c.moe_z_loss_coeff = c.moe_z_loss_coeff * self.tp * share
        try:
            yield
        finally:
            c.moe_aux_loss_coeff, c.moe_z_loss_coeff = saved
            if self.expert_load is not None:
                self.expert_load.paused = False

    def moe_metrics(self, num_micro_batches: int) -> dict[str, float]:
        """Collective (every rank): router losses and expert load of the last training `forward_backward`
        over `num_micro_batches` ({} for a dense or frozen model; see `workers.megatron.moe_metrics`)."""
        if self.expert_load is None:
            return {}
        return self.expert_load.step_metrics(num_micro_batches, self.device)

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> dict[str, float]:
        """Check, clip and apply the accumulated gradients; returns grad_norm, lr and skipped (1.0 when
        the global grad norm was NaN/Inf and the step was skipped). fp16 also returns its dynamic loss scale:
        a step whose scaled gradients overflowed while the scale could still back off is not applied either,
        but it is the scaler's search for a scale (megatron's loop treats it so), so it reports
        loss_scale_backoff 1.0 instead of skipped."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        opt = self.optimizer
        found_inf = opt.prepare_grads()  # fp16: also updates the loss scale
        grad_norm = float(opt.get_grad_norm())
        lr = float(opt.param_groups[0]["lr"])
        subs = getattr(opt, "chained_optimizers", [opt])
        scaler = next((s.grad_scaler for s in subs if getattr(s, "grad_scaler", None) is not None), None)
        scale = {"loss_scale": float(scaler.scale), "loss_scale_backoff": 0.0} if scaler is not None else {}
        if found_inf or not math.isfinite(grad_norm):
            self.zero_grad()
            if found_inf and scale and float(getattr(scaler, "min_scale", scaler.scale)) < scale["loss_scale"]:
                log.info("fp16 gradients overflowed: loss scale backed off to %g", scale["loss_scale"])
                return {"grad_norm": grad_norm, "lr": lr, "skipped": 0.0, **scale, "loss_scale_backoff": 1.0}
            log.warning("non-finite grad norm %s: optimizer step skipped", grad_norm)
            return {"grad_norm": grad_norm, "lr": lr, "skipped": 1.0, **scale}
        if self.optim.clip_grad > 0:
            for sub in getattr(opt, "chained_optimizers", [opt]):
                params = sub.get_parameters()
                if params:
                    clip_grad_by_total_norm_fp32(
                        params, max_norm=self.optim.clip_grad, total_norm=grad_norm,
                        use_decoupled_grad=sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                    )
        ok = opt.step_with_ready_grads()
        self.scheduler.step(increment=1)
        self.steps += 1
        return {"grad_norm": grad_norm, "lr": lr, "skipped": 0.0 if ok else 1.0, **scale}

    def finish_param_gather(self) -> None:
        """With `overlap_param_gather`, finish the all-gather of the updated shards now (a no-op otherwise):
        the forwards gather their buckets as they need them, but a weight sync, an export or a checkpoint
        reads every parameter directly."""
        if self.trainable and self.optim.overlap_param_gather:
            for chunk in self.chunks:
                chunk.start_param_sync(force_sync=True)

    # ---- checkpoints --------------------------------------------------------------------------
    def _layout(self) -> dict[str, int]:
        from megatron.core import parallel_state as ps

        return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
                "dp": ps.get_data_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size(),
                "cp": ps.get_context_parallel_world_size()}

    def _rng_object(self, data: Any) -> Any:
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        lay = self._layout()
        return ShardedObject("rng_state", data, (lay["pp"], lay["tp"]),
                             (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                             replica_id=ps.get_data_parallel_rank(with_context_parallel=True))

    def _sharded_state(self, with_optimizer: bool, is_loading: bool) -> dict[str, Any]:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        model_sd = self.module.sharded_state_dict()
        if self.lora is not None:  # the base comes from model_path: only the adapters are saved and loaded
            from workers.megatron.lora import is_adapter_key

            model_sd = {k: v for k, v in model_sd.items() if is_adapter_key(k)}
        state: dict[str, Any] = {"model": model_sd}
        if with_optimizer and self.optimizer is not None:
            meta = _DIST_OPT_META if self.optim.use_distributed_optimizer else None
            state["optimizer"] = self.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=meta)
        rng = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
        if not cuda_absent():
            rng["cuda"] = torch.cuda.get_rng_state()
        state["rng"] = self._rng_object(rng)
        return state

    def save_checkpoint(self, path: str | Path) -> None:
        """Collective: write model, optimizer, scheduler, step and RNG state under `path`."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        self.finish_param_gather()
        if torch.distributed.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()
        if self.optimizer is not None:  # no step taken yet (or every one skipped, e.g. fp16 overflow): zero
            _ensure_adam_state(self.optimizer)  # state, so the checkpoint holds what a load expects
        state = self._sharded_state(with_optimizer=True, is_loading=False)
        state["meta"] = {"layout": self._layout(), "steps": self.steps, "value_head": self.value_head}
        if self.lora is not None:
            state["meta"]["lora"] = {**dataclasses.asdict(self.lora), "base_model": str(self.model_path)}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        with torch.no_grad():
            dist_checkpointing.save(state, str(path))
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            write_manifest(path)  # last: the digests a later load checks; the driver signs them (ckpt_manifest)
        torch.distributed.barrier()

    def load_checkpoint(self, path: str | Path, load_optimizer: bool = True, load_rng: bool = True,
                        trust: bool = False) -> dict[str, Any]:
        """Collective: load a checkpoint written by `save_checkpoint`, possibly at another layout.

        The model always loads (any TP/PP/EP/DP). With `load_optimizer` (and a trainable engine): the
        optimizer state, scheduler and step count; the distributed optimizer's state loads at another DP
        (`dp_reshardable`), not at another TP/PP. Without it, the optimizer's main params are refreshed
        from the loaded weights (bf16 keeps fp32 copies). The RNG loads with `load_rng` at the same
        TP/PP/EP layout only (it is per model-parallel rank, and experts have an RNG stream per EP rank).
        The folder must match its manifest's digests (ckpt_manifest.py; the driver checked its signature before
        this worker started) unless `trust`. Returns the saved metadata."""
        from megatron.core import dist_checkpointing

        check_saved_files(path, trust)  # before anything in the folder is unpickled
        path = str(path)
        common = dist_checkpointing.load_common_state_dict(path)
        meta = dict(common.get("meta", {}))
        _check_lora_match(meta.get("lora"), self.lora, path, str(self.model_path))
        saved = {"ep": 1, "cp": 1, **meta.get("layout", {})}  # checkpoints from before expert / context parallelism
        same_mp = {k: v for k, v in saved.items() if k != "dp"} == {k: v for k, v in self._layout().items() if k != "dp"}
        with_opt = load_optimizer and self.optimizer is not None
        if with_opt:
            _ensure_adam_state(self.optimizer)  # a never-stepped optimizer has no state to describe
        state = self._sharded_state(with_optimizer=with_opt, is_loading=True)
        if not (same_mp and load_rng):
            state.pop("rng")
        with torch.no_grad():
            loaded = dist_checkpointing.load(state, path)
            if self.lora is None:
                self.module.load_state_dict(loaded["model"])
            else:  # adapters only; the frozen base stays as loaded from model_path
                self.module.load_state_dict(loaded["model"], strict=False)
            if with_opt:
                # the param groups' max_lr / min_lr come back with the state; the config's schedule sets them
                peaks = [{k: g[k] for k in ("max_lr", "min_lr") if k in g} for g in self.optimizer.param_groups]
                _zero_missing_adam_steps(loaded["optimizer"])
                self.optimizer.load_state_dict(loaded["optimizer"])
                for g, peak in zip(self.optimizer.param_groups, peaks, strict=True):
                    g.update(peak)
                _restore_adam_steps(self.optimizer)
            elif self.optimizer is not None:
                self.optimizer.reload_model_params()
        if with_opt:
            if "scheduler" in common and self.scheduler is not None:
                self.scheduler.load_state_dict(common["scheduler"])
            self.steps = int(meta.get("steps", 0))
        if "rng" in loaded:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

            rng = loaded["rng"]
            torch.set_rng_state(rng["torch"])
            get_cuda_rng_tracker().set_states(rng["tracker"])
            if "cuda" in rng and not cuda_absent():
                torch.cuda.set_rng_state(rng["cuda"])
        return meta

    # ---- weights ------------------------------------------------------------------------------
    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective over the whole world: full HF-named tensors (gathered over TP and PP)."""
        from workers.megatron.hf_weights import iter_hf_weights

        self.finish_param_gather()
        yield from iter_hf_weights(self.module, self.hf_config)

    def offload(self) -> None:
        """Move parameters to CPU (frozen models on GPU only; a no-op on CPU)."""
        if self.device.type == "cpu" or self._offloaded or self.trainable:
            return
        for p in self.module.parameters():
            p.data = p.data.to("cpu", non_blocking=True)
        self._offloaded = True
        torch.cuda.empty_cache()

    def onload(self) -> None:
        if not self._offloaded:
            return
        for p in self.module.parameters():
            p.data = p.data.to(self.device, non_blocking=True)
        self._offloaded = False


def _check_context_parallel(cp: int, pp: int, moe: bool, config: Any, explicit_positions: bool) -> None:
    """Raise ValueError (naming what to change) for a model or layout context parallelism does not run."""
    why = None
    if pp > 1:
        why = "with pipeline parallelism (each stage would pass split activations): use pp=1"
    elif moe:
        why = "with an MoE model (routing replay and the router losses work on whole rows): use ep and dp"
    elif getattr(config, "multi_latent_attention", False):
        why = "with multi-head latent attention (its per-layer RoPE is not split): use tp"
    elif not explicit_positions:
        why = "with fused RoPE (each rank's tokens need RoPE at their own positions)"
    if why:
        raise ValueError(f"context parallelism (cp={cp}) does not run {why}")


def _check_lora_match(saved: dict[str, Any] | None, lora: LoRAConfig | None, path: str, base: str) -> None:
    """A checkpoint's adapters fit this engine: both LoRA with the same rank and targets, or neither (one
    line naming what differs). The scale and dropout may change; a different base model is only logged."""
    if saved is None and lora is None:
        return
    if saved is None:
        raise ValueError(f"checkpoint {path} holds a full model, not LoRA adapters: train it further without "
                         "policy.lora, or export it to HF and use that folder as the base model")
    if lora is None:
        raise ValueError(f"checkpoint {path} holds LoRA adapters (rank {saved['rank']} on "
                         f"{', '.join(saved['target_modules'])}) of {saved['base_model']}: load it with the same "
                         "policy.lora settings")
    for key, now in (("rank", lora.rank), ("targets", list(lora.targets()))):
        was = saved["rank"] if key == "rank" else list(LoRAConfig(target_modules=saved["target_modules"]).targets())
        if was != now:
            raise ValueError(f"checkpoint {path} holds LoRA adapters with {key} {was}, the config has {now} "
                             "(policy.lora must match the checkpoint's)")
    if saved["base_model"] != base:
        log.warning("checkpoint %s: LoRA adapters trained on %s, loaded onto %s", path, saved["base_model"], base)


def _mark_expert_params(model: torch.nn.Module) -> None:
    """Treat the routed experts' parameters as expert-parallel (megatron's `allreduce=False`) at EP=1 too.

    megatron-core marks them only when EP > 1; then DDP reduces their gradients over the expert-data-
    parallel group and `get_megatron_optimizer` gives them an optimizer of their own (a ChainedOptimizer
    of dense + expert), whose checkpoint keys differ from a single optimizer's. At EP=1 the expert-data-
    parallel group is the data-parallel group, so the gradients are the same, and the optimizer state
    has the same keys at every EP: a checkpoint saved at EP=2 resumes at EP=1 and the reverse."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for module in model.modules():
        if isinstance(module, MoELayer):  # its routed experts, whichever implementation (not the shared expert)
            for p in module.experts.parameters():
                p.allreduce = False


def _inner_optimizers(optimizer: Any) -> list[Any]:
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    return [s.optimizer for s in subs if getattr(s, "optimizer", None) is not None]


def _ensure_adam_state(optimizer: Any) -> None:
    """Zero Adam state for parameters that have none yet (before loading into a never-stepped optimizer:
    megatron-core's distributed optimizer with the torch-Adam fallback asserts on a missing 'step')."""
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p.data)
                    state["exp_avg_sq"] = torch.zeros_like(p.data)


def _zero_missing_adam_steps(state: Any) -> None:
    """Give step 0 to loaded Adam states without one: megatron-core 0.16.1 saves the optimizer's shared step
    only when it is non-zero (`if step:`), so a checkpoint from before the first step loads without it, and
    torch's Adam rejects a state with moments but no step."""
    values = state.values() if isinstance(state, dict) else state if isinstance(state, list) else ()
    for v in values:
        if isinstance(v, dict) and "exp_avg" in v and "step" not in v:
            v["step"] = torch.tensor(0.0)
        else:
            _zero_missing_adam_steps(v)


def _restore_adam_steps(optimizer: Any) -> None:
    """Give every parameter its own Adam `step` tensor after a checkpoint load.

    megatron-core 0.16.1's distributed optimizer (torch AdamW fallback without Apex/TE) loads the step
    as ONE tensor shared by every parameter's state; torch's AdamW then increments it in place once
    per parameter, so after the first step each parameter has a different, wrong step (bias
    correction off; measured 3e-4 weight error after one step at lr 1e-3). Each parameter gets a
    private copy of the saved step (the param group's `step` when present).
    """
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state.get(p)
                if not state or "step" not in state:
                    continue
                saved = group.get("step", state["step"])
                value = float(saved.item() if isinstance(saved, torch.Tensor) else saved)
                if isinstance(state["step"], torch.Tensor):
                    state["step"] = torch.tensor(value, dtype=state["step"].dtype, device=state["step"].device)
                else:
                    state["step"] = value


class _ValueHeadSource(HFTensorSource):
    """HF tensors for a value model built from a causal-LM folder: the LM head is dropped and, when the
    folder has no `score.weight`, a deterministic one is made (same on every rank and layout)."""

    def __init__(self, src: HFTensorSource, hidden: int, seed: int = 0) -> None:
        self.src, self.hidden, self.seed = src, hidden, seed
        self._has_score = "score.weight" in src.shapes()

    def shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {k: v for k, v in self.src.shapes().items() if k != "lm_head.weight"}
        shapes.setdefault("score.weight", (1, self.hidden))
        return shapes

    def get(self, name: str) -> torch.Tensor:
        if name == "score.weight" and not self._has_score:
            g = torch.Generator().manual_seed(self.seed)
            return torch.randn(1, self.hidden, generator=g) / math.sqrt(self.hidden + 1)
        return self.src.get(name)

    def close(self) -> None:
        self.src.close()
