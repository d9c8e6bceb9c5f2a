"""`Micro`: one micro-batch as the Megatron engine runs it (also `workers.megatron.engine.Micro`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Micro:
    """One micro-batch ready for the model: trimmed token block, masks and the per-sample fields."""

    input_ids: torch.Tensor  # [b, s]
    position_ids: torch.Tensor  # [b, s]
    attention_mask: torch.Tensor  # [b, 1, s, s] bool, True = masked
    fields: dict[str, torch.Tensor]  # per-sample tensors the loss needs (any width)
    offset: int = 0  # columns trimmed from the left of the original block
    explicit_positions: bool = False  # RoPE at `position_ids` (rows that are not one contiguous sequence)
    # MoE routing replay: the experts to use per token [b, s, layers, top-k] (-1: the router's own choice)
    routes: torch.Tensor | None = None
    # further model inputs, per row (a vision-language model's `pixel_values` / `image_grid_thw`)
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
