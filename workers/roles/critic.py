"""`CriticWorker`: a Megatron GPT with a value head; per-token values and the clipped value loss.

`compute_values(batch)` returns `values` [B, R]: the value at the position that predicts response
token j (column P-1+j), 0 at padding. `train_step(batch, loss_config)` needs `values` (old values),
`returns` and `response_mask` [B, R].
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from algorithms import global_normalizer, value_loss
from workers.batch import Batch
from workers.dispatch import DP_COMPUTE, register, split_by_minibatch
from workers.megatron.engine import Micro
from workers.roles.base import MegatronWorker
from workers.roles.micro import join_outputs, pad_right, response_micros, response_slice
from workers.roles.optimize import Metrics, MicroLoss, UpdateConfig, optimize


@dataclass
class ValueLossConfig(UpdateConfig):
    """What `train_step` needs besides the batch (a dict with these keys is accepted)."""

    value_clip: float | None = 0.2
    agg_mode: str = "token-mean"


class CriticWorker(MegatronWorker):
    value_head = True

    @register(DP_COMPUTE)
    def compute_values(self, batch: Batch, micro_batch_size: int | None = None) -> Batch:
        """`values` [B, R] for the response positions (0 at padding)."""
        eng = self.engine
        r = batch["responses"].shape[1]
        micros = response_micros(batch, micro_batch_size or self.micro_batch_size, ["responses"], eng.device,
                                 pack=self.pack_sequences)

        def loss_fn(mb: Micro, out: torch.Tensor):
            sl, _ = response_slice(mb, out)
            data = {"values": pad_right(sl[..., 0].float().cpu(), r)}
            if "_index" in mb.fields:
                data["_index"] = mb.fields["_index"]
            return torch.zeros((), device=out.device), data

        with self.onloaded():
            outs = eng.forward_backward(micros, loss_fn, forward_only=True)
        if not outs:
            return Batch()
        values = join_outputs(outs, "values")
        if "response_mask" in batch:
            values = values * batch["response_mask"].to(values.dtype)
        return Batch({"values": values})

    @register(DP_COMPUTE, pad=False, split=split_by_minibatch())
    def train_step(self, batch: Batch, loss_config: dict[str, Any] | ValueLossConfig | None = None) -> dict[str, float]:
        """Clipped value loss over `ppo_epochs` x `mini_batches` optimizer steps; returns averaged metrics
        (vf_loss, vf_clipfrac, vpred_mean, grad_norm, lr, skipped_steps, ...)."""
        cfg = ValueLossConfig.from_any(loss_config)
        eng = self.engine
        t0 = time.monotonic()
        keys = ["responses", "response_mask", "values", "returns"]

        def prepare(mini: Batch) -> tuple[list[Micro], MicroLoss]:
            norm = self.dp_all_reduce(global_normalizer(mini["response_mask"], cfg.agg_mode))
            micros = response_micros(mini, cfg.micro_batch_size or self.micro_batch_size, keys, eng.device,
                                     pack=self.pack_sequences)

            def loss_fn(mb: Micro, out: torch.Tensor, acc: Metrics) -> torch.Tensor:
                sl, r_eff = response_slice(mb, out)
                f = {k: v[:, :r_eff] for k, v in mb.fields.items() if not k.startswith("_")}
                mask = f["response_mask"].to(torch.float32)
                loss, m = value_loss(sl[..., 0].float(), f["values"].float(), f["returns"].float(), mask,
                                     cfg.value_clip, cfg.agg_mode, normalizer=norm)
                acc.add_sum({"vf_loss": loss.detach(), "tokens": float(mask.sum())})
                acc.add_mean(m, weight=float(mask.sum()))
                return loss

            return micros, loss_fn

        out = optimize(self, batch, cfg, prepare)
        out["time_s"] = time.monotonic() - t0
        return out
