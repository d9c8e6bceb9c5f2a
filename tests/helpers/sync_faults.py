"""Weight-sync faults, injected through transport subclasses that Ray pickles by value into the policy and
engine actors (`by_value`): each is a fault the per-sync digest (workers/rollout/digest.py) must catch."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import ray
import torch

from workers.rollout.cpu.shm import ShmTransport
from workers.rollout.weight_sync import GlooTransport

# an element changed in flight: fused into the engine's qkv_proj
CORRUPT, CORRUPT_ROW, CORRUPT_COL = "model.layers.1.self_attn.k_proj.weight", 2, 5
# HF tensor -> how the engine receives it wrong (the policy at TP 2: the shard boundaries are the halves)
SHARD_FAULTS = {
    # column-parallel: TP rank 1's rows where rank 0's belong and the other way round
    "swapped": ("model.layers.0.mlp.gate_proj.weight", lambda t: torch.cat(t.chunk(2, dim=0)[::-1])),
    # row-parallel and square (tiny-qwen2: 128 x 128): as a loader that forgot a transpose gives it
    "transposed": ("model.layers.1.self_attn.o_proj.weight", lambda t: t.t().contiguous()),
}
ZEROED_LAYER, ZEROED_EXPERT = 1, 2  # the MoE layer and routed expert ZeroedExpertGloo zeroes


@contextlib.contextmanager
def by_value() -> Iterator[None]:
    """Ray pickles this module by value while inside, so the actors get its classes."""
    module = sys.modules[__name__]
    ray.cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        ray.cloudpickle.unregister_pickle_by_value(module)


class CorruptGloo(GlooTransport):
    """gloo whose sender changes one element of CORRUPT after digesting its bucket, before sending it."""

    def send_bucket(self, out, buf, meta):
        if CORRUPT in meta.names:
            i = meta.names.index(CORRUPT)
            buf[meta.offsets[i] + CORRUPT_ROW * meta.shapes[i][1] + CORRUPT_COL] += 1.0
        super().send_bucket(out, buf, meta)


class SkippingShm(ShmTransport):
    """shm whose engines (those in SKIP; None: all) wait for the writers, then keep their old weights (a sync
    that did not take)."""

    SKIP: tuple[int, ...] | None = None

    def receive(self, vworker, session, engine_rank, tp):
        if self.SKIP is not None and engine_rank not in self.SKIP:
            return super().receive(vworker, session, engine_rank, tp)
        rank = self.sync_rank(vworker, engine_rank, tp)
        self.channel(session, 0, rank).wait_flags([session.key(0, f"shm/done/r{r}") for r in session.writer_ranks])
        return {"rank": engine_rank, "bytes": 0, "tensors": 0, "recv_s": 0.0, "load": "skipped"}


class SecondEngineSkipsShm(SkippingShm):
    """shm whose second engine (rank 1) keeps its old weights; the first loads the new ones."""

    SKIP = (1,)


class ShardFaultGloo(GlooTransport):
    """gloo whose engines receive the tensor of SHARD_FAULTS[FAULT] wrong."""

    FAULT = "swapped"

    def _stream(self, session, rank, progress):
        name, fault = SHARD_FAULTS[self.FAULT]
        for key, view in super()._stream(session, rank, progress):
            yield key, (fault(view) if key == name else view)


class SwappedShardGloo(ShardFaultGloo):
    FAULT = "swapped"


class TransposedShardGloo(ShardFaultGloo):
    FAULT = "transposed"


class ZeroedExpertGloo(GlooTransport):
    """gloo whose engine, once it loaded the sync, zeroes routed expert ZEROED_EXPERT's gate and up weights
    (its slice of the fused w13) in layer ZEROED_LAYER."""

    def receive(self, vworker, session, engine_rank, tp):
        stats = super().receive(vworker, session, engine_rank, tp)
        params = dict(vworker.model_runner.get_model().named_parameters())
        with torch.no_grad():
            params[f"model.layers.{ZEROED_LAYER}.mlp.experts.routed_experts.w13_weight"][ZEROED_EXPERT].zero_()
        return stats
