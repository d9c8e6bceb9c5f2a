"""The scalar value head that replaces GPTModel's output layer in critic and reward models."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class ValueHead(torch.nn.Module):
    """Scalar head replacing GPTModel.output_layer: hidden [s, b, h] -> [s, b, 1], replicated over TP.

    Accepts the output layer's call signature (`weight=`, `runtime_gather_output=`) and returns
    (output, None) like a ColumnParallelLinear.
    """

    def __init__(self, config) -> None:
        super().__init__()
        self.sequence_parallel = bool(config.sequence_parallel)
        self.weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype))
        torch.nn.init.normal_(self.weight, std=1.0 / math.sqrt(config.hidden_size + 1))

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True)
        return F.linear(hidden, self.weight), None
