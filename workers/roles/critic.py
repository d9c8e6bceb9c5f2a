"""`CriticWorker`: a Megatron GPT with a value head; per-token values and the clipped value loss.

`compute_values(batch)` returns `values` [B, R]: the value at the position that predicts response
token j (column P-1+j), 0 at padding. `train_step(batch, loss_config)` needs `values` (old values),
`returns` and `response_mask` [B, R].
"""

from __future__ import annotations

from typing import Any

import torch

from algorithms import value_loss
from workers.batch import Batch
from workers.config import build
from workers.dispatch import DP_COMPUTE, register, split_by_minibatch
from workers.roles.base import MegatronWorker
from workers.roles.loss_config import ValueLossConfig
from workers.roles.micro import forward_responses
from workers.roles.optimize import Metrics, optimize_responses


class CriticWorker(MegatronWorker):
    value_head = True

    @register(DP_COMPUTE)
    def compute_values(self, batch: Batch, micro_batch_size: int | None = None) -> Batch:
        """`values` [B, R] for the response positions (0 at padding)."""
        return forward_responses(self, batch, micro_batch_size, lambda out, _: {"values": out[..., 0]})

    @register(DP_COMPUTE, pad=False, split=split_by_minibatch())
    def train_step(self, batch: Batch, loss_config: dict[str, Any] | ValueLossConfig | None = None,
                   micro_batch_size: int | None = None) -> dict[str, float]:
        """Clipped value loss over `ppo_epochs` x `mini_batches` optimizer steps; returns averaged metrics
        (vf_loss, vf_clipfrac, vpred_mean, grad_norm, lr, skipped_steps, ...)."""
        cfg = build(ValueLossConfig, loss_config)

        def loss_fn(sl: torch.Tensor, f: dict[str, torch.Tensor], mask: torch.Tensor, norm: torch.Tensor,
                    acc: Metrics) -> torch.Tensor:
            loss, m = value_loss(sl[..., 0].float(), f["values"].float(), f["returns"].float(), mask,
                                 cfg.value_clip, cfg.loss_agg_mode, normalizer=norm)
            acc.add_sum({"vf_loss": loss.detach(), "tokens": float(mask.sum())})
            acc.add_mean(m, weight=float(mask.sum()))
            return loss

        return optimize_responses(self, batch, cfg, ["values", "returns"], loss_fn, micro_batch_size)
