"""The update loop of every trainable role: `optimize` (epochs x mini-batches of optimizer steps) over
`run_loss` (one pass of a loss over micro-batches: zero_grad, forward/backward, step, metrics over DP).

A loss here is `loss(micro, output, acc) -> tensor`: the micro-batch's share of the global loss (already
divided by the global normaliser, so the result does not depend on the micro-batch count or the DP
size), recording its metrics in `acc` (`Metrics`). `run_loss` undoes the schedule's division by the
micro-batch count and DDP's average over DP, so the gradients are those of the global loss.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from algorithms import global_normalizer
from workers.batch import Batch
from workers.megatron.engine import Micro
from workers.roles.base import MegatronWorker
from workers.roles.loss_config import UpdateConfig
from workers.roles.micro import response_micros, response_slice


class Metrics:
    """Per-micro-batch metrics, reduced over the DP group on the last PP stage: `add_sum` values are
    summed (e.g. loss parts already divided by the global normaliser, token counts), `add_mean` values
    are weighted means (e.g. clipfrac weighted by tokens), `add_max` values their maximum."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.wsums: dict[str, float] = {}
        self.weights: dict[str, float] = {}
        self.maxes: dict[str, float] = {}

    @staticmethod
    def _f(v: Any) -> float:
        return float(v.detach()) if isinstance(v, torch.Tensor) else float(v)

    def add_sum(self, values: dict[str, Any]) -> None:
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + self._f(v)

    def add_mean(self, values: dict[str, Any], weight: float = 1.0) -> None:
        for k, v in values.items():
            self.wsums[k] = self.wsums.get(k, 0.0) + self._f(v) * weight
            self.weights[k] = self.weights.get(k, 0.0) + weight

    def add_max(self, values: dict[str, Any]) -> None:
        for k, v in values.items():
            self.maxes[k] = max(self.maxes.get(k, -float("inf")), self._f(v))

    def reduce(self, group: Any, active: bool, device: torch.device) -> dict[str, float]:
        """Collective over `group` when `active` (call it on the last PP stage only); {} otherwise. The sums
        travel on `device` (NCCL reduces CUDA tensors only)."""
        if not active:
            return {}
        sk, mk = sorted(self.sums), sorted(self.wsums)
        t = torch.tensor([self.sums[k] for k in sk] + [self.wsums[k] for k in mk] + [self.weights[k] for k in mk],
                         dtype=torch.float64)
        if t.numel() and torch.distributed.get_world_size(group) > 1:
            t = t.to(device)
            torch.distributed.all_reduce(t, group=group)
            t = t.cpu()
        out = {k: t[i].item() for i, k in enumerate(sk)}
        n, m = len(sk), len(mk)
        for i, k in enumerate(mk):
            w = t[n + m + i].item()
            out[k] = t[n + i].item() / w if w > 0 else 0.0
        return out | self._reduce_max(group, device)

    def _reduce_max(self, group: Any, device: torch.device) -> dict[str, float]:
        keys = sorted(self.maxes)
        t = torch.tensor([self.maxes[k] for k in keys], dtype=torch.float64)
        if t.numel() and torch.distributed.get_world_size(group) > 1:
            t = t.to(device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
            t = t.cpu()
        return {k: t[i].item() for i, k in enumerate(keys)}


MicroLoss = Callable[[Micro, torch.Tensor, Metrics], torch.Tensor]
# (output at the response positions [b, r, ...], the micro-batch's fields trimmed to r, response mask
# [b, r] float, the mini-batch's global normaliser, metrics) -> the micro-batch's share of the loss
ResponseLoss = Callable[[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, torch.Tensor, Metrics], torch.Tensor]


def run_loss(worker: MegatronWorker, micros: list[Micro], loss: MicroLoss, train: bool = True) -> dict[str, float]:
    """`loss` over `micros`: forward only, or with `train` zero_grad, backward and one optimizer step.
    Returns the metrics reduced over DP (on the last PP stage; {} elsewhere), with grad_norm, lr and
    skipped when training, and for an MoE model its router metrics (`MegatronEngine.moe_metrics`)."""
    eng = worker.engine
    scale = float(len(micros) * eng.dp_size())
    acc = Metrics()

    def loss_fn(mb: Micro, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
        return loss(mb, output, acc) * scale, {}

    if train:
        eng.zero_grad()
    with worker.onloaded():
        eng.forward_backward(micros, loss_fn, forward_only=not train)
    moe = eng.moe_metrics(len(micros)) if train else {}
    step = eng.optimizer_step() if train else {}
    return {**acc.reduce(eng.dp_group(), eng.is_last_stage, eng.device), **moe, **step}


def optimize(worker: MegatronWorker, batch: Batch, cfg: UpdateConfig,
             prepare: Callable[[Batch], tuple[list[Micro], MicroLoss]]) -> dict[str, float]:
    """`cfg.ppo_epochs` x `cfg.mini_batches` optimizer steps; `prepare(mini_batch)` gives each step's
    micro-batches and loss. Returns the steps' metrics averaged (`mean_steps`)."""
    minis = batch.split(max(1, cfg.mini_batches))
    return mean_steps([run_loss(worker, *prepare(mini)) for _ in range(max(1, cfg.ppo_epochs)) for mini in minis])


def optimize_responses(worker: MegatronWorker, batch: Batch, cfg: UpdateConfig, keys: list[str],
                       loss: ResponseLoss, micro_batch_size: int | None = None,
                       norm_mask: Callable[[Batch], torch.Tensor] | None = None) -> dict[str, float]:
    """`optimize` with a loss over the response tokens (the policy's and the critic's): each mini-batch's
    normaliser is `cfg.loss_agg_mode`'s over all DP ranks, of `norm_mask(mini_batch)` when the loss trains on
    fewer tokens than the response mask (else of the mask); the micro-batches carry `responses`,
    `response_mask` and `keys`. Adds time_s to the metrics."""
    t0 = time.monotonic()
    eng = worker.engine

    def prepare(mini: Batch) -> tuple[list[Micro], MicroLoss]:
        mask = mini["response_mask"] if norm_mask is None else norm_mask(mini)
        norm = worker.dp_all_reduce(global_normalizer(mask, cfg.loss_agg_mode))
        micros = response_micros(mini, micro_batch_size or worker.micro_batch_size,
                                 ["responses", "response_mask", *keys], eng.device, pack=worker.pack_sequences)

        def loss_fn(mb: Micro, output: torch.Tensor, acc: Metrics) -> torch.Tensor:
            sl, r_eff = response_slice(mb, output)
            f = {k: v[:, :r_eff] for k, v in mb.fields.items() if not k.startswith("_")}
            return loss(sl, f, f["response_mask"].to(torch.float32), norm, acc)

        return micros, loss_fn

    out = optimize(worker, batch, cfg, prepare)
    out["time_s"] = time.monotonic() - t0
    return out


def mean_steps(per_step: list[dict[str, float]]) -> dict[str, float]:
    """Average of per-step metrics, plus grad_norm_max, skipped_steps, num_steps and the summed tokens."""
    if not per_step:
        return {}
    keys = sorted({k for s in per_step for k in s})
    out = {k: sum(s.get(k, 0.0) for s in per_step) / len(per_step) for k in keys}
    out["grad_norm_max"] = max(s.get("grad_norm", 0.0) for s in per_step)
    out["skipped_steps"] = sum(s.get("skipped", 0.0) for s in per_step)
    out["num_steps"] = float(len(per_step))
    out["tokens"] = sum(s.get("tokens", 0.0) for s in per_step)
    out.pop("skipped", None)
    return out
