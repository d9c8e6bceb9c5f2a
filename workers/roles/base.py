"""`MegatronWorker`: a group rank whose world is megatron-core parallel state and whose model is a
`MegatronEngine`. Shared by the policy, reference, critic and reward-model roles.

init_kwargs (from `WorkerGroup(init_kwargs=...)`): the fields of `MegatronOptions` (workers/roles/options.py;
`lora`: LoRA adapters, the trained policy only).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from workers.config import build
from workers.dispatch import ONE_TO_ALL, register
from workers.group.worker import Worker
from workers.megatron.cpu_compat import cpu_device_mode
from workers.megatron.engine import MegatronEngine
from workers.megatron.memory_levers import describe
from workers.roles.options import MegatronOptions


class MegatronWorker(Worker):
    """Base of the Megatron roles: sets up megatron parallel state and builds `self.engine`."""

    trainable = True
    value_head = False

    def __init__(self, ctx: Any, **init_kwargs: Any) -> None:
        import warnings

        # megatron-core's fallbacks without Transformer Engine / Apex warn once per import site
        warnings.filterwarnings("ignore", message=".*(Transformer Engine and Apex|Apex is not installed|"
                                "full scope is deprecated|CUDA_DEVICE_MAX_CONNECTIONS).*")
        super().__init__(ctx, **init_kwargs)
        self.options = build(MegatronOptions, init_kwargs)  # an unknown key fails here, naming the known ones

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        from megatron.core import parallel_state as ps

        from workers.megatron.dist_setup import init_distributed

        c = self.ctx
        init_distributed(c.rank, c.world_size, master_addr, master_port, tp=c.tp, pp=c.pp, backend=c.backend,
                         timeout_s=c.timeout_s, seed=c.seed, ep=self.options.ep, cp=c.cp)
        self.dp_rank = ps.get_data_parallel_rank()
        self.cp_rank = ps.get_context_parallel_rank()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()

    def rank_info(self) -> dict[str, Any]:
        """The group's rank info plus `expert_dp_rank` once megatron's parallel state is up (the "shm" weight
        sync picks its expert writers by it)."""
        from megatron.core import parallel_state as ps

        info = super().rank_info()
        if ps.model_parallel_is_initialized():
            info["expert_dp_rank"] = ps.get_expert_data_parallel_rank()
        return info

    def call_context(self) -> contextlib.AbstractContextManager:
        """Every actor method runs in the CPU device mode (a no-op with CUDA; see cpu_compat)."""
        return cpu_device_mode()

    def setup(self) -> None:
        o = self.options
        if not o.model_path:
            raise ValueError(f"{self.ctx.name}: init_kwargs need model_path (the HF folder the role loads)")
        self.micro_batch_size = int(o.micro_batch_size)
        self.offload_between_calls = bool(o.offload)
        self.engine = MegatronEngine(o.model_path, dtype=o.dtype, value_head=self.value_head, trainable=self.trainable,
                                     optim=o.optim, moe=o.moe, lora=o.lora, load_weights=o.load_weights,
                                     recompute=o.recompute, recompute_num_layers=o.recompute_num_layers,
                                     sequence_parallel=o.sequence_parallel, freeze_vision=o.freeze_vision)
        self._log(describe(self.engine.config, self.engine.optim if self.trainable else None, self.engine.cp))
        pack = o.pack_sequences
        if pack is None:
            pack = "prefix" if self.engine.supports_explicit_positions else True
        if pack == "prefix" and not self.engine.supports_explicit_positions:
            raise ValueError("pack_sequences='prefix' needs RoPE at explicit positions, which this model's "
                             "(fused) RoPE does not take; use pack_sequences=True")
        self.pack_sequences = pack if pack == "prefix" else bool(pack)
        if self.offload_between_calls:
            self.engine.offload()

    @contextlib.contextmanager
    def onloaded(self) -> Iterator[None]:
        """Parameters on the device for the duration (offloaded again afterwards when configured)."""
        self.engine.onload()
        try:
            yield
        finally:
            if self.offload_between_calls:
                self.engine.offload()

    # ---- methods every role has -------------------------------------------------------------
    @register(ONE_TO_ALL, collect="rank0")
    def save_checkpoint(self, path: str) -> str:
        """Model, optimizer, scheduler and RNG through dist_checkpointing; returns `path`."""
        t0 = time.monotonic()
        self.engine.save_checkpoint(path)
        self._log(f"saved checkpoint {path} in {time.monotonic() - t0:.1f}s")
        return path

    @register(ONE_TO_ALL, collect="rank0")
    def load_checkpoint(self, path: str, load_optimizer: bool = True, load_rng: bool = True,
                        trust: bool = False) -> dict[str, Any]:
        """Load a `save_checkpoint` directory through `MegatronEngine.load_checkpoint`: the model at any
        TP/PP/DP; the optimizer, scheduler and step count with `load_optimizer` (trainer.no_load_optim
        turns it off); the RNG with `load_rng` (same TP/PP layout only); a folder without a matching
        manifest only with `trust` (trainer.trust_checkpoint). Returns the saved metadata."""
        meta = self.engine.load_checkpoint(path, load_optimizer=load_optimizer, load_rng=load_rng, trust=trust)
        self._log(f"loaded checkpoint {path} (saved at {meta.get('layout')}; "
                  f"optimizer={load_optimizer} rng={load_rng})")
        return meta

    @register(ONE_TO_ALL, collect="rank0")
    def save_hf_weights(self, out_dir: str, tokenizer_path: str | None = None) -> str:
        """Write the full weights as an HF folder (safetensors per pipeline stage + index, config.json,
        generation config, tokenizer from `tokenizer_path` or the model folder) into `out_dir`; collective.
        A value-head model (reward model, critic) is written as `*ForSequenceClassification` with one label
        (`workers.roles.hf_export`)."""
        from workers.roles.hf_export import export_hf_folder

        return str(export_hf_folder(self.engine, out_dir, tokenizer_path or self.engine.model_path))

    def _log(self, msg: str) -> None:
        import logging

        logging.getLogger("workers").info("%s: %s", self.ctx.name, msg)

    # ---- helpers for training loops -----------------------------------------------------------
    def dp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """SUM over the data-parallel group (in place; returns `t`). The sum travels on the engine's device,
        since NCCL reduces CUDA tensors only."""
        if self.engine.dp_size() > 1:
            buf = t.to(self.engine.device)
            torch.distributed.all_reduce(buf, group=self.engine.dp_group())
            t.copy_(buf)
        return t
