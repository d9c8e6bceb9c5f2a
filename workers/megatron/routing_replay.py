"""Routing replay: MoE routers that use given experts per token (R3: the ones the rollout engine chose) and
record the experts they used.

megatron-core 0.16.1's top-k routing (`moe_utils.topk_routing_with_score_function`) asks the router's
`router_replay` object for the top-k of its scores (`get_replay_topk`): that is the one place every
top-k router (softmax or sigmoid scores, with or without expert bias or group-limited top-k) picks its
experts, so a replay installed there is router-agnostic. `RouteReplay` is such an object: where a token
has recorded experts it returns them, with the router's own scores gathered at those experts as the
routing probabilities (so the router's logits still get gradients, through the experts it did not
choose itself); elsewhere (id -1: a position the engine never routed, EP padding, filler micro-batches)
the router's own top-k. Either way it records the experts it used. megatron's own `RouterReplay` replays
all tokens or none and keeps one process-wide list of instances; ours is per router and per micro-batch.

Routes are laid out like the micro-batch's tokens, [b, s, L, k] (L = the model's layers, global
numbering; each router reads its own layer's slice, so a pipeline stage uses only its layers' routes).
The router sees tokens in megatron's [s, b] order, flattened; under sequence parallelism (MoE at TP > 1)
each TP rank routes its own slice of the sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]
UNROUTED = -1  # the expert id of a (token, layer) without a recorded routing


class RouteReplay:
    """The `router_replay` of one router (see module docstring): `target` [tokens, k] (ids, -1 = choose
    freely) or None, and `recorded` [tokens, k], the experts of the last forward."""

    def __init__(self) -> None:
        self.target: torch.Tensor | None = None
        self.recorded: torch.Tensor | None = None

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: TopK | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        assert default_compute_topk is not None
        probs, idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is not None:
            target = self.target.to(device=scores.device, dtype=idx.dtype)
            if target.shape != idx.shape:
                raise ValueError(f"routing replay: {tuple(target.shape)} recorded routes for a router that routes "
                                 f"{tuple(idx.shape)} [tokens, top-k]")
            idx = torch.where((target >= 0).all(-1, keepdim=True), target, idx)
            probs = scores.gather(1, idx)
        self.recorded = idx.detach()
        return probs, idx


class RoutingReplay:
    """The replay objects of a model's routers, set per micro-batch (`set`) and read back (`recorded`)."""

    def __init__(self, model: torch.nn.Module, num_layers: int, topk: int, sequence_parallel: bool = False,
                 device: torch.device | str = "cpu") -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.moe.router import Router

        self.num_layers, self.topk, self.device = num_layers, topk, torch.device(device)
        # with sequence parallelism each TP rank routes its own slice of the sequence
        self.tp = ps.get_tensor_model_parallel_world_size() if sequence_parallel else 1
        self.tp_rank = ps.get_tensor_model_parallel_rank() if sequence_parallel else 0
        self.tp_group = ps.get_tensor_model_parallel_group() if self.tp > 1 else None
        self.routers: dict[int, RouteReplay] = {}  # 0-based global layer -> its router's replay
        for module in model.modules():
            if isinstance(module, Router) and module.layer_number is not None and hasattr(module, "router_replay"):
                replay = RouteReplay()
                module.router_replay = replay
                self.routers[module.layer_number - 1] = replay

    def set(self, routes: torch.Tensor | None) -> None:
        """Before a forward: `routes` [b, s, L, k] (-1 = the router's own choice) or None (no replay)."""
        for layer, replay in self.routers.items():
            if routes is None:
                replay.target = None
                continue
            if routes.shape[2:] != (self.num_layers, self.topk):
                raise ValueError(f"routing replay: routes of shape {tuple(routes.shape)}; the model has "
                                 f"{self.num_layers} layers and top-{self.topk} routing ([b, s, layers, top-k])")
            replay.target = self._local(routes[:, :, layer].transpose(0, 1)).reshape(-1, self.topk)

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        """This TP rank's slice of `x` [s, ...] under sequence parallelism (all of it otherwise)."""
        chunk = x.shape[0] // self.tp
        return x[self.tp_rank * chunk:(self.tp_rank + 1) * chunk]

    def recorded(self, b: int, s: int) -> torch.Tensor:
        """After a forward of a [b, s] micro-batch: the experts each router used, [b, s, L, k] int16 (-1 in
        the layers this rank has no router for: dense layers, other pipeline stages). Under sequence
        parallelism a collective over the TP group (each rank routed its slice of the sequence)."""
        out = torch.full((s, b, self.num_layers, self.topk), UNROUTED, dtype=torch.int32)
        mine = self._local(out)
        for layer, replay in self.routers.items():
            if replay.recorded is not None:
                mine[:, :, layer] = replay.recorded.to("cpu", torch.int32).view(-1, b, self.topk)
        if self.tp_group is not None:
            t = out.to(self.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.tp_group)
            out = t.cpu()
        return out.transpose(0, 1).to(torch.int16)

    def clear(self) -> None:
        for replay in self.routers.values():
            replay.target = replay.recorded = None


def install(model: torch.nn.Module, config: Any, device: torch.device) -> RoutingReplay:
    """Replay objects on every router of `model` (a megatron GPT with MoE layers on `device`)."""
    return RoutingReplay(model, int(config.num_layers), int(config.moe_router_topk), bool(config.sequence_parallel),
                         device)
