"""Enumerate the parallel layouts of a model on a cluster, estimate each, rank the ones that fit.

A layout fits when its fullest GPU (the pipeline rank with the most bytes) stays within `headroom` of the
GPU's memory (the rest is left to the allocator's fragmentation). Layouts rank by estimated step time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from rlhf.errors import UserError
from rlhf.plan.estimate import StepTime, step_time
from rlhf.plan.hardware import GIB, GPU
from rlhf.plan.layout import RECOMPUTE, Layout
from rlhf.plan.memory import (
    ActOptions,
    Breakdown,
    ParamCount,
    kv_cache_bytes,
    layer_activation_per_token,
    rank_layers,
    rank_params,
    stage_activation_bytes,
    state_bytes,
    total_params,
)
from rlhf.plan.model import ModelSpec

ROLES = ("policy", "reference", "critic", "reward_model", "rollout")
HEADROOM = 0.95


@dataclass(frozen=True)
class Request:
    model: ModelSpec
    gpu: GPU
    nodes: int
    gpus_per_node: int
    gpu_mem: float  # bytes
    seq: int
    global_batch: int  # sequences per optimizer step
    roles: tuple[str, ...] = ("policy",)
    colocate: bool = False
    param_bytes: int = 2  # bf16
    headroom: float = HEADROOM
    flash_attention: bool = True

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable(self) -> float:
        return self.gpu_mem * self.headroom


@dataclass
class Plan:
    layout: Layout
    memory: Breakdown
    time: StepTime
    feasible: bool
    missing: list[str] = field(default_factory=list)  # levers our config cannot set yet

    @property
    def runnable_today(self) -> bool:
        return not self.missing


def missing_levers(m: ModelSpec, lay: Layout) -> list[str]:
    """What this layout needs that rlhf's config cannot express yet (policy.parallel has tp, cp, pp, dp and
    ep, experts keeping the dense TP; a role's recompute, sequence_parallel and optim.cpu_offload set the
    others; context parallelism runs for dense models at pp=1)."""
    out = []
    if lay.cp > 1 and (m.moe or m.mla or lay.pp > 1):
        why = "an MoE model" if m.moe else "MLA" if m.mla else "pipeline parallelism"
        out.append(f"context parallel cp={lay.cp} with {why}")
    if lay.vpp > 1:
        out.append(f"virtual pipeline vpp={lay.vpp}")
    if m.moe and lay.etp != lay.tp:
        out.append(f"expert tensor parallel etp={lay.etp}")
    if m.layers % (lay.pp * lay.vpp):
        out.append(f"uneven pipeline stages ({m.layers} layers over pp={lay.pp})")
    return out


def cp_gathered_extra(req: Request, lay: Layout) -> float:
    """Activation bytes per GPU that the engine's all-gather context-parallel attention keeps beyond the ring
    attention the estimate assumes (the other ranks' K / V, unfused scores over the whole sequence); 0 at
    cp=1. Context parallelism runs at pp=1, where one micro-batch is in flight."""
    if lay.cp == 1:
        return 0.0
    ring = ActOptions(elem=req.param_bytes, flash_attention=req.flash_attention)
    gathered = ActOptions(elem=req.param_bytes, flash_attention=req.flash_attention, cp_gathered_kv=True)
    return (stage_activation_bytes(req.model, lay, req.seq, 1, 0, gathered)
            - stage_activation_bytes(req.model, lay, req.seq, 1, 0, ring))


def _pow2_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


class Planner:
    """Estimates layouts of one request, caching parameter counts and per-layer activations."""

    def __init__(self, req: Request) -> None:
        if req.seq < 1 or req.global_batch < 1 or req.nodes < 1 or req.gpus_per_node < 1:
            raise UserError("--seq-len, --global-batch, --nodes and --gpus-per-node must be >= 1")
        self.req = req
        self.m = req.model
        self.act = ActOptions(elem=req.param_bytes, flash_attention=req.flash_attention)

    @functools.cache  # noqa: B019 - one planner per request, freed with it
    def _params(self, tp: int, pp: int, vpp: int, ep: int, etp: int, rank: int, value_head: bool) -> ParamCount:
        return rank_params(self.m, Layout(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp), rank, value_head)

    @functools.cache  # noqa: B019
    def _layer_act(self, moe: bool, key: Layout) -> float:
        idx = next(i for i in range(self.m.layers) if self.m.is_moe_layer(i) == moe)
        return layer_activation_per_token(self.m, idx, key, self.req.seq / key.cp, self.act)

    def _activations(self, lay: Layout, rank: int, micro: int) -> float:
        def per_token(i: int, lay_: Layout) -> float:
            key = lay_.with_(mbs=1, offload=False, dp=1, pp=1, vpp=1, dist_opt=True)
            return self._layer_act(self.m.is_moe_layer(i), key)

        return stage_activation_bytes(self.m, lay, self.req.seq, micro, rank, self.act, per_token)

    @functools.cache  # noqa: B019
    def _candidate_ranks(self, pp: int, vpp: int) -> tuple[int, ...]:
        """The pipeline ranks that can be the fullest: the first rank of each distinct mix of (dense, MoE)
        layers (later ranks with the same mix hold fewer micro-batches in flight), and the last rank."""
        seen, out = set(), []
        for rank in range(pp):
            layers = rank_layers(self.m.layers, pp, vpp, rank)
            mix = (len(layers), sum(1 for i in layers if self.m.is_moe_layer(i)))
            if mix not in seen or rank in (0, pp - 1):
                seen.add(mix)
                out.append(rank)
        return tuple(out)

    def evaluate(self, lay: Layout) -> Plan:
        req, m = self.req, self.m
        micro = req.global_batch // (lay.dp * lay.mbs)
        roles = set(req.roles) if req.colocate else {"policy"}
        best: Breakdown | None = None
        best_pc = ParamCount()
        for rank in self._candidate_ranks(lay.pp, lay.vpp):
            pc = self._params(lay.tp, lay.pp, lay.vpp, lay.ep, lay.etp, rank, False)
            st = state_bytes(pc, lay, req.param_bytes, True)
            b = Breakdown(params=st["params"], grads=st["grads"], optimizer=st["optimizer"])
            b.activations = self._activations(lay, rank, micro)
            if "reference" in roles:
                b.params += pc.total * req.param_bytes
            if "reward_model" in roles:
                b.params += pc.total * req.param_bytes
            if "critic" in roles:
                cpc = self._params(lay.tp, lay.pp, lay.vpp, lay.ep, lay.etp, rank, True)
                for k, v in state_bytes(cpc, lay, req.param_bytes, True).items():
                    setattr(b, k, getattr(b, k) + v)
            if "rollout" in roles:
                # vLLM at the trainer's TP holds a full copy of its TP shard and the KV cache to hold the whole
                # batch at once (every sequence at full length), spread over world / tp engines.
                b.params += total_params(m) * req.param_bytes / lay.tp
                engines = req.world // lay.tp
                b.kv_cache = kv_cache_bytes(m, req.global_batch * req.seq / engines, lay.tp, req.param_bytes)
            if best is None or b.total > best.total:
                best, best_pc = b, pc
        assert best is not None
        t = step_time(m, lay, req.gpu, req.gpus_per_node, req.seq, req.global_batch, best_pc, req.param_bytes)
        missing = missing_levers(m, lay)
        if lay.cp > 1 and not missing and best.total + cp_gathered_extra(req, lay) > req.usable:
            missing.append(f"ring attention for cp={lay.cp} (the engine's all-gather CP attention keeps "
                           f"{cp_gathered_extra(req, lay) / GIB:.1f} GiB more per GPU)")
        return Plan(lay, best, t, best.total <= req.usable, missing)

    def layouts(self, offload: bool) -> list[Layout]:
        req, m = self.req, self.m
        world, out = req.world, []
        for tp in _pow2_upto(req.gpus_per_node):
            if m.heads % tp or (not m.mla and m.kv_heads % tp) or (m.ffn % tp and not all(m.moe_layers or [False])):
                continue
            if m.moe and m.shared_ffn % tp:
                continue
            for cp in _pow2_upto(8):
                if world % (tp * cp) or req.seq % (2 * cp) and cp > 1 or req.seq // cp < 512 and cp > 1:
                    continue
                rest = world // (tp * cp)
                for pp in [p for p in range(1, min(rest, m.layers) + 1) if rest % p == 0]:
                    dp = rest // pp
                    vpps = [1] + ([2] if pp > 1 and m.layers % (2 * pp) == 0 else [])
                    eps = [e for e in _pow2_upto(min(m.experts, tp * cp * dp)) if m.experts % e == 0] if m.moe else [1]
                    for vpp in vpps:
                        for ep in eps:
                            for etp in ([tp, 1] if m.moe and tp > 1 else [tp]):
                                if m.moe and ((tp * cp * dp) % (etp * ep) or m.moe_ffn % etp):
                                    continue
                                sps = [False, True] if tp > 1 else [False]
                                if m.moe and ep > 1 and tp > 1:
                                    sps = [True]  # megatron requires SP with MoE under TP and EP
                                for sp in sps:
                                    for mbs in (1, 2, 4, 8):
                                        if req.global_batch % (dp * mbs):
                                            continue
                                        micro = req.global_batch // (dp * mbs)
                                        if vpp > 1 and micro % pp:
                                            continue
                                        for rc in RECOMPUTE:
                                            out.append(Layout(tp=tp, pp=pp, dp=dp, cp=cp, vpp=vpp, ep=ep, etp=etp,
                                                              mbs=mbs, sp=sp, recompute=rc, offload=offload,
                                                              dist_opt=dp * cp > 1))
        return out

    def plan(self) -> list[Plan]:
        """Every layout's plan, fitting ones first by step time, then the rest by memory. Optimizer offload
        is tried only when nothing fits without it."""
        plans = [self.evaluate(lay) for lay in self.layouts(offload=False)]
        if not plans:
            raise UserError(f"no parallel layout divides this model on {self.req.world} GPUs with global batch "
                            f"{self.req.global_batch} (check heads {self.m.heads}, KV heads {self.m.kv_heads}, "
                            f"layers {self.m.layers} against the GPU counts)")
        if not any(p.feasible for p in plans):
            plans += [self.evaluate(lay) for lay in self.layouts(offload=True)]
        plans.sort(key=lambda p: (not p.feasible, p.time.total if p.feasible else p.memory.total, p.memory.total))
        return plans


def advice(planner: Planner, plans: list[Plan]) -> str:
    """For a model that fits nowhere: how far over the closest layout is, and the lever that helps most."""
    req = planner.req
    closest = min(plans, key=lambda p: p.memory.total)
    over = (closest.memory.total - req.usable) / GIB
    b = closest.memory
    parts = {"parameters": b.params, "gradients": b.grads, "optimizer state": b.optimizer,
             "activations": b.activations, "KV cache": b.kv_cache}
    largest = max(parts, key=lambda k: parts[k])
    levers: dict[str, float] = {}
    lay = closest.layout
    if lay.recompute != "full":
        levers["full activation recompute"] = b.total - planner.evaluate(lay.with_(recompute="full")).memory.total
    if not lay.offload:
        levers["optimizer CPU offload"] = b.total - planner.evaluate(lay.with_(offload=True)).memory.total
    more = Planner(Request(**{**req.__dict__, "nodes": req.nodes * 2}))
    try:
        doubled = min(p.memory.total for p in more.plan())
        levers[f"twice the GPUs ({req.nodes * 2} nodes)"] = b.total - doubled
    except UserError:
        pass
    if req.seq > 1:
        shorter = Planner(Request(**{**req.__dict__, "seq": req.seq // 2}))
        levers[f"half the sequence length ({req.seq // 2})"] = b.total - min(p.memory.total for p in shorter.plan())
    lever = max(levers, key=lambda k: levers[k]) if levers else "none"
    return (f"{req.model.name} does not fit on {req.world} x {req.gpu_mem / GIB:.0f} GiB: the closest layout "
            f"({lay.short()}) needs {b.total / GIB:.1f} GiB per GPU, {over:.1f} GiB over the usable "
            f"{req.usable / GIB:.1f} GiB; its largest share is {largest} ({parts[largest] / GIB:.1f} GiB); "
            f"the lever that helps most: {lever} (saves {levers.get(lever, 0.0) / GIB:.1f} GiB)")
