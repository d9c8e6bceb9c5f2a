"""Per-step metrics of an MoE model's routers in a training pass: the router losses and the expert load.

- `moe/aux_loss`, `moe/z_loss` (when their coefficients are > 0): megatron's aux-loss tracker values
  (the losses before their coefficients), averaged over micro-batches and data-parallel ranks, then over
  the MoE layers. `moe/aux_loss` is the load-balancing loss of `moe.load_balancing_type`; a perfectly
  balanced router gives 1 (its minimum).
- `moe/load_imbalance`: per MoE layer, the most tokens routed to one expert over the mean per expert,
  counted over the whole step (all micro-batches and data-parallel ranks, padding tokens included), then
  averaged over the layers; `moe/load_imbalance_max`: the worst layer; `moe/load_imbalance/layer{i}`: layer
  i's (0-based). 1 = perfectly balanced, at most num_experts / top-k (every token on the same k experts).
"""

from __future__ import annotations

from typing import Any

import torch

from workers.megatron.moe_config import MoEConfig


class ExpertLoad:
    """Tokens each MoE layer's router sends to each expert in training forwards (forward hooks on the
    routers), and the step's metrics (`step_metrics`, a collective over DP and PP)."""

    def __init__(self, model: torch.nn.Module, config: Any, moe: MoEConfig) -> None:
        from megatron.core.transformer.moe.router import Router

        self.moe = moe
        pattern = config.moe_layer_freq
        if isinstance(pattern, int):
            pattern = [int(i % pattern == 0) for i in range(config.num_layers)]
        self.moe_layers = [i for i, sparse in enumerate(pattern) if sparse]
        self.sequence_parallel = bool(config.sequence_parallel)
        self.counts = torch.zeros(config.num_layers, config.num_moe_experts, dtype=torch.float64)
        self.paused = False  # EP filler micro-batches are not counted
        for module in model.modules():
            if isinstance(module, Router):
                module.register_forward_hook(self._count)

    def _count(self, module: Any, inputs: Any, output: Any) -> None:
        if self.paused or not (module.training and torch.is_grad_enabled()) or module.layer_number is None:
            return
        routing_map = output[1]  # [tokens, experts] bool
        padding = inputs[1] if len(inputs) > 1 else None  # [s, b] bool, True on EP alignment padding
        if padding is not None:
            routing_map = routing_map[~padding.reshape(-1)]
        self.counts[module.layer_number - 1] += routing_map.sum(0).to(device="cpu", dtype=torch.float64)

    def reset(self) -> None:
        """Forget the counts and megatron's tracked router losses (before a training pass)."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        self.counts.zero_()
        clear_aux_losses_tracker()

    def step_metrics(self, num_micro_batches: int, device: torch.device) -> dict[str, float]:
        """The metrics of the training pass since `reset` (see module docstring). Collective over the
        data-parallel and pipeline groups (every rank of the model calls it); the same dict on every rank."""
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        losses = self.moe.tracked_losses()
        rows = []
        for name in losses.values():
            values = tracker.get(name, {}).get("values")
            rows.append(torch.zeros(self.counts.shape[0], dtype=torch.float64) if values is None
                        else values.detach().to("cpu", torch.float64) / max(1, num_micro_batches))
        n = len(rows)
        flat = torch.cat([torch.stack(rows).flatten() if rows else torch.zeros(0, dtype=torch.float64),
                          self.counts.flatten()]).to(device)
        dp = ps.get_data_parallel_world_size()
        if dp > 1:
            torch.distributed.all_reduce(flat, group=ps.get_data_parallel_group())
        tp = ps.get_tensor_model_parallel_world_size()
        if self.sequence_parallel and tp > 1:
            # each TP rank routed its own slice of the sequence: its token counts and load-balancing losses are
            # shares of the micro-batch's (megatron's aux losses are partial sums), its z-loss a mean over its slice
            torch.distributed.all_reduce(flat, group=ps.get_tensor_model_parallel_group())
            for i, tracked in enumerate(losses.values()):
                if tracked == "z_loss":
                    flat[i * self.counts.shape[0]:(i + 1) * self.counts.shape[0]] /= tp
        if ps.get_pipeline_model_parallel_world_size() > 1:  # each stage holds its own layers' rows
            torch.distributed.all_reduce(flat, group=ps.get_pipeline_model_parallel_group())
        flat = flat.cpu()
        layers = self.moe_layers
        per_layer = flat[: n * self.counts.shape[0]].view(n, -1) / dp if n else None
        out = {metric: float(per_layer[i, layers].mean()) for i, metric in enumerate(losses)} if n else {}
        counts = flat[n * self.counts.shape[0]:].view(self.counts.shape)[layers]
        mean = counts.mean(1)
        if bool((mean > 0).all()):
            imbalance = counts.max(1).values / mean
            out["moe/load_imbalance"] = float(imbalance.mean())
            out["moe/load_imbalance_max"] = float(imbalance.max())
            out |= {f"moe/load_imbalance/layer{i}": float(v) for i, v in zip(layers, imbalance.tolist())}
        return out
