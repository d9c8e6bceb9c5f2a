"""`LMWorker`: the RL policy worker, plus pretraining / SFT steps on Megatron-layout token batches.

It is a `PolicyWorker` (same engine, checkpoints and weight export), so SFT and pretraining run on the
same worker group and Megatron engine as RL. Batch layout of `train_lm_step` / `eval_lm` (what
`rlhf.data.pretrain` and `rlhf.data.sft.collate_sft` produce), all [B, S]:
- `tokens` int64 inputs, `labels` int64 next-token targets (labels[t] is predicted from tokens[..t]);
- `loss_mask` float32, 1 where labels[t] is trained (0 on padding / prompts / masked eod);
- `position_ids` int64; a row holds packed samples when its positions restart at 0. The attention
  mask is rebuilt here from the positions: causal within each segment (block-diagonal when packed).
A batch with `input_ids` instead of `tokens` goes to `PolicyWorker.train_lm_step` (the RL layout).

Loss: token-mean cross-entropy over the whole global batch: every micro-batch divides its summed NLL by
the number of loss tokens in the global batch (all-reduced over DP), so the loss and the gradients do
not depend on the micro-batch count, the DP size or how rows are split.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from algorithms import agg_loss, global_normalizer
from workers.batch import LM_KEYS, Batch
from workers.dispatch import DP_COMPUTE, ONE_TO_ALL, register
from workers.megatron.engine import Micro
from workers.megatron.masks import causal_mask
from workers.roles.logits import vocab_parallel_logprobs
from workers.roles.policy import PolicyWorker


def lm_attention_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """Bool mask, True = masked: [1, 1, S, S] causal when no row restarts its positions, else
    [B, 1, S, S] causal within the segments that start where position_ids == 0."""
    s = position_ids.shape[1]
    causal = causal_mask(s, device=position_ids.device)
    seg = (position_ids == 0).long().cumsum(-1)
    if bool((seg == seg[:, :1]).all()):
        return causal[None, None]
    same = seg[:, :, None] == seg[:, None, :]
    return (~same | causal[None]).unsqueeze(1)


def lm_micros(batch: Batch, micro_batch_size: int, device: torch.device) -> list[Micro]:
    """Micro-batches of an LM batch. Columns after the last loss token of a micro-batch are dropped:
    with causal attention they cannot change any trained prediction."""
    out = []
    for chunk in batch.chunks(max(1, micro_batch_size)):
        mask = chunk["loss_mask"].to(torch.float32)
        used = (mask != 0).any(0).nonzero().flatten()
        hi = int(used.max()) + 1 if used.numel() else 1
        tokens, pos = chunk["tokens"][:, :hi].to(device), chunk["position_ids"][:, :hi].to(device)
        fields = {"labels": chunk["labels"][:, :hi].to(device), "loss_mask": mask[:, :hi].to(device)}
        out.append(Micro(tokens, pos, lm_attention_mask(pos), fields))
    return out


class LMWorker(PolicyWorker):
    """The policy worker with pretraining / SFT steps, evaluation, checkpoint options and HF export."""

    @register(DP_COMPUTE, pad=False)
    def train_lm_step(self, batch: Batch, agg_mode: str = "token-mean", micro_batch_size: int | None = None
                      ) -> dict[str, float]:
        """One optimizer step over the batch (gradient accumulation over its micro-batches).

        Returns loss (global token-mean), tokens (loss tokens in the global batch), grad_norm (before
        clipping), lr (of this step), skipped (1.0 when the grad norm was NaN/Inf and the step skipped)."""
        if "tokens" not in batch:
            return PolicyWorker.train_lm_step.__wrapped__(self, batch, agg_mode, micro_batch_size)
        t0 = time.monotonic()
        eng = self.engine
        out = self._lm_pass(batch, micro_batch_size, forward_only=False)
        out.update(eng.optimizer_step())
        out["time_s"] = time.monotonic() - t0
        return out

    @register(DP_COMPUTE, pad=False)
    def eval_lm(self, batch: Batch, micro_batch_size: int | None = None) -> dict[str, float]:
        """Forward-only token-mean loss over the batch (all DP shards together) and its token count."""
        return self._lm_pass(batch, micro_batch_size, forward_only=True)

    def _lm_pass(self, batch: Batch, micro_batch_size: int | None, forward_only: bool) -> dict[str, float]:
        eng = self.engine
        missing = [k for k in LM_KEYS if k not in batch]
        if missing:
            raise ValueError(f"LM batch lacks {missing}; it has {batch.keys()}")
        norm = self.dp_all_reduce(global_normalizer(batch["loss_mask"].to(torch.float32), "token-mean"))
        micros = lm_micros(batch, micro_batch_size or self.micro_batch_size, eng.device)
        # The schedule divides each micro-batch loss by their number and DDP averages gradients over DP.
        scale = float(len(micros) * eng.dp_size())
        acc = torch.zeros(2, dtype=torch.float64)  # [sum of micro losses, loss tokens]

        def loss_fn(mb: Micro, logits: torch.Tensor):
            mask = mb.fields["loss_mask"]
            logp, _ = vocab_parallel_logprobs(logits, mb.fields["labels"], eng.vocab_size)
            loss = agg_loss(-logp, mask, "token-mean", normalizer=norm.clamp(min=1.0))
            acc[0] += float(loss.detach())
            acc[1] += float(mask.sum())
            return loss * scale, {}

        if not forward_only:
            eng.zero_grad()
        with self.onloaded():
            eng.forward_backward(micros, loss_fn, forward_only=forward_only)
        if eng.is_last_stage:
            self.dp_all_reduce(acc)
        return {"loss": float(acc[0]), "tokens": float(acc[1])}

    # ---- checkpoints ----------------------------------------------------------------------------
    @register(ONE_TO_ALL, collect="rank0")
    def load_checkpoint(self, path: str, load_optim: bool = True, load_rng: bool = True,
                        load_optimizer: bool | None = None) -> dict[str, Any]:
        """Load a `save_checkpoint` folder: the model always (any TP/PP/DP); optimizer, scheduler and step
        with `load_optim` (Megatron's --no-load-optim is load_optim=False); the RNG with `load_rng`
        (same TP/PP layout only). `load_optimizer` is an alias of `load_optim`."""
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        if load_optimizer is not None:
            load_optim = load_optimizer
        before = (torch.get_rng_state(), get_cuda_rng_tracker().get_states())
        if load_optim:
            self._init_empty_optimizer_state()
        meta = self.engine.load_checkpoint(path, load_optimizer=load_optim)
        if not load_optim and self.engine.optimizer is not None:
            self.engine.optimizer.reload_model_params()  # bf16/fp16 main params follow the loaded weights
        if not load_rng:
            torch.set_rng_state(before[0])
            get_cuda_rng_tracker().set_states(before[1])
        elif not load_optim:
            self._load_rng_only(path, meta)
        self._log(f"loaded checkpoint {path} (saved at {meta.get('layout')}; optim={load_optim} rng={load_rng})")
        return meta

    def _init_empty_optimizer_state(self) -> None:
        """Give a never-stepped optimizer its (zero) Adam state so the distributed optimizer can describe
        the state it is about to load (megatron-core's torch-Adam fallback asserts on a missing 'step')."""
        for inner in self._inner_optimizers():
            for group in inner.param_groups:
                for p in group["params"]:
                    state = inner.state[p]
                    if not state:
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = torch.zeros_like(p.data)
                        state["exp_avg_sq"] = torch.zeros_like(p.data)

    def _inner_optimizers(self) -> list[Any]:
        opt = self.engine.optimizer
        if opt is None:
            return []
        subs = getattr(opt, "chained_optimizers", [opt])
        return [s.optimizer for s in subs if getattr(s, "optimizer", None) is not None]

    def _load_rng_only(self, path: str, meta: dict[str, Any]) -> None:
        """The engine restores the RNG together with the optimizer only; this loads it alone."""
        from megatron.core import dist_checkpointing
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        layout = {k: v for k, v in meta.get("layout", {}).items() if k != "dp"}
        if layout != {k: v for k, v in self.engine._layout().items() if k != "dp"}:
            return  # per model-parallel rank: not transferable to another TP/PP layout
        state = {"rng": self.engine._rng_object({"torch": torch.get_rng_state(),
                                                 "tracker": get_cuda_rng_tracker().get_states()})}
        rng = dist_checkpointing.load(state, path)["rng"]
        torch.set_rng_state(rng["torch"])
        get_cuda_rng_tracker().set_states(rng["tracker"])

    # ---- HF export ------------------------------------------------------------------------------
    @register(ONE_TO_ALL, collect="rank0")
    def export_hf(self, path: str, tokenizer_path: str | None = None) -> str:
        """Collective: write an HF folder (safetensors per pipeline stage + index, config.json,
        generation config and tokenizer files) to `path`; returns `path`."""
        from workers.roles.hf_export import export_hf_folder

        export_hf_folder(self.engine, path, tokenizer_path or self.engine.model_path)
        return str(Path(path))
