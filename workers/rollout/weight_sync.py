"""The bucketed transports of weight sync: "gloo" (CPU), "nccl" (GPU, engines apart), "cuda_ipc" (GPU,
colocated). The "shm" transport, the CPU default on one host, is in cpu/shm.py.

One bucketed sync:
1. Driver (`WeightSyncer.sync`, syncer.py): builds a `SyncSession` (the control endpoint in rollout engine
   0, the source rank of each pipeline stage), runs `send_weights_to_rollout(session)` on every policy
   rank and `RolloutWorker.receive_weights(session)` on every engine, and waits for both under the timeout.
2. Policy (`send`): every rank iterates `iter_hf_weights` (collective over TP). The stage's source rank
   (tp 0, dp 0) packs the tensors, cast to the engine's dtype, into buckets of `bucket_bytes` (whole
   fused modules only, reusable buffers) and sends each one; the other ranks only take part in the
   gathers. gloo / nccl: one stateless process group per stage over {source, receivers}; bucket k is
   broadcast asynchronously while bucket k+1 is packed. cuda_ipc: a copy of each bucket is shared by
   handle, double-buffered against the engines' acknowledgements. A failed send keeps draining the
   iterator so the policy's collectives stay in step, then raises.
3. Engine (`receive`): ONE `reload_weights` call (cpu/engine_ops.py; per-bucket calls would leave layers
   half loaded) with a lazy iterator that receives bucket after bucket, stage 0 first, and yields views
   into it. Peak extra memory: the sender's buffers, a few receive buffers, vLLM's per-layer staging.
4. Driver: optional verification of the engine's logprobs against the policy's (syncer.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.dtypes import as_dtype
from workers.net import gloo_group
from workers.rollout.buckets import BucketMeta, BucketPacker, BufferPool, unpack
from workers.rollout.control import Channel
from workers.rollout.cpu import engine_ops
from workers.rollout.digest import Sent, policy_names
from workers.rollout.transport import SyncSession, Transport, sync_error
from workers.rollout.wire import END


@dataclass
class Outbox:
    """The source rank's state during one send of one pipeline stage."""

    ch: Channel
    session: SyncSession
    stage: int
    sent: int = 0
    work: Any = None  # gloo / nccl: the broadcast in flight
    shared: list[torch.Tensor] = field(default_factory=list)  # cuda_ipc: the bucket copies shared by handle

    def key(self, what: str) -> str:
        return self.session.key(self.stage, what)


class BucketTransport(Transport):
    """Buckets from each stage's source rank to every engine, broadcast over the channel's process group."""

    device = "cpu"
    num_buffers = 2  # bucket k is in flight while bucket k+1 is packed

    def __init__(self) -> None:
        super().__init__()
        self._pool = BufferPool()  # receive buffers of this process, reused across syncs

    # ---- policy side ---------------------------------------------------------------------------
    def send(self, worker: Any, session: SyncSession) -> dict[str, Any]:
        rank, stage = worker.ctx.rank, worker.pp_rank
        weights = worker.engine.iter_hf_weights()
        t0 = time.perf_counter()
        if worker.tp_rank != 0 or worker.dp_rank != 0 or worker.cp_rank != 0:
            n = sum(1 for _ in weights)
            return {"rank": rank, "source": False, "tensors": n, "time_s": time.perf_counter() - t0}
        out: Outbox | None = None
        error: BaseException | None = None
        try:
            out = Outbox(self.channel(session, stage, rank=0), session, stage)
        except BaseException as exc:  # noqa: BLE001 - reported after draining
            error = exc
        packer = BucketPacker(session.bucket_bytes, session.dtype, device=self.device,
                              buffers=out.ch.pack_buffers if out else None, num_buffers=self.num_buffers)
        clock = {"gather_s": 0.0, "send_s": 0.0, "digest_s": 0.0}
        digests: dict[str, Sent] = {}
        for buf, meta in packer.buckets(_timed(weights, clock, "gather_s")):
            if error is not None:
                continue  # keep iterating: the other ranks of this stage are in the same collectives
            try:
                t = time.perf_counter()
                if session.digest:  # of the values as sent: cast to the engine's dtype, packed
                    digests.update((name, Sent.of(view, name, session.digest_stride, session.sync_id))
                                   for name, view in unpack(buf, meta))
                    clock["digest_s"] += time.perf_counter() - t
                    t = time.perf_counter()
                self.send_bucket(out, buf, meta)  # type: ignore[arg-type]
                out.sent += 1  # type: ignore[union-attr]
                clock["send_s"] += time.perf_counter() - t
            except BaseException as exc:  # noqa: BLE001
                error = exc
        if error is None:
            try:
                t = time.perf_counter()
                self.finish(out)  # type: ignore[arg-type]
                clock["send_s"] += time.perf_counter() - t
            except BaseException as exc:  # noqa: BLE001
                error = exc
        if out is not None:
            out.ch.pack_buffers = packer.buffers
        if error is not None:
            self.drop(session)
            raise sync_error(error, f"policy rank {rank} (pipeline stage {stage}) could not send bucket "
                             f"{out.sent if out else 0} to the rollout engines ({self.name}, timeout "
                             f"{session.timeout_s:g}s)") from error
        extra = {"digests": digests, "policy_names": policy_names(worker)} if session.digest else {}
        return {"rank": rank, "source": True, "stage": stage, "buckets": packer.num_buckets,
                "tensors": packer.num_tensors, "bytes": packer.total_bytes, "max_bucket_bytes": packer.max_bucket_bytes,
                "time_s": time.perf_counter() - t0, **clock, **extra}

    def send_bucket(self, out: Outbox, buf: torch.Tensor, meta: BucketMeta) -> None:
        """Publish the bucket's meta, then broadcast it (waiting for the previous broadcast first)."""
        _wait(out)
        out.ch.publish(out.key(f"b{meta.index}"), meta)
        out.work = out.ch.broadcast_async(buf)

    def finish(self, out: Outbox) -> None:
        _wait(out)
        out.ch.publish(out.key(f"b{out.sent}"), END)

    # ---- engine side ---------------------------------------------------------------------------
    def receive(self, vworker: Any, session: SyncSession, engine_rank: int, tp: int) -> dict[str, Any]:
        rank = self.sync_rank(vworker, engine_rank, tp)
        progress = {"stage": 0, "bucket": 0, "buckets": 0, "bytes": 0, "tensors": 0, "recv_s": 0.0}
        try:
            engine_ops.reload_on_worker(vworker, self._stream(session, rank, progress))
        except BaseException as exc:
            self.drop(session)
            src = session.source_ranks[progress["stage"]] if progress["stage"] < session.num_stages else "?"
            raise sync_error(exc, f"rollout rank {engine_rank} (sync rank {rank}) waiting for bucket "
                             f"{progress['bucket']} of pipeline stage {progress['stage']} from policy rank {src} "
                             f"({self.name}, timeout {session.timeout_s:g}s); the engine's weights are now "
                             f"partly updated, so sync again before generating") from exc
        return {"rank": engine_rank, **{k: progress[k] for k in ("buckets", "bytes", "tensors", "recv_s")}}

    def _stream(self, session: SyncSession, rank: int, progress: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
        """Receive the buckets of every pipeline stage in order and yield (name, view) pairs."""
        self.forget_old_keys(session, rank)
        for stage in range(session.num_stages):
            progress.update(stage=stage, bucket=0)
            ch = self.channel(session, stage, rank)
            k = 0
            while True:
                progress["bucket"] = k
                t = time.perf_counter()
                key = session.key(stage, f"b{k}")
                item = ch.fetch(key)
                self.remember(session, rank, key)
                if isinstance(item, str) and item == END:
                    break
                buf, meta = self.receive_bucket(ch, session, item)
                progress["recv_s"] += time.perf_counter() - t
                yield from self._pool.views(buf, meta)
                self.received(ch, session, stage, k, rank)
                progress["bytes"] += meta.nbytes
                progress["tensors"] += len(meta.names)
                progress["buckets"] += 1
                k += 1

    def receive_bucket(self, ch: Channel, session: SyncSession, item: Any) -> tuple[torch.Tensor, BucketMeta]:
        """The data of the bucket whose published `item` was fetched."""
        buf = self._pool.get(item.numel, as_dtype(session.dtype), self._device())
        ch.broadcast(buf)
        return buf, item

    def received(self, ch: Channel, session: SyncSession, stage: int, index: int, rank: int) -> None:
        """Called once the engine has consumed bucket `index` of `stage`."""

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else torch.device("cpu")


class GlooTransport(BucketTransport):
    """CPU, bounded memory or several hosts (64 MB broadcast in ~0.02 s here)."""

    name = "gloo"

    @staticmethod
    def make_group(store: Any, rank: int, size: int, timeout: Any) -> Any:
        return gloo_group(store, rank, size, timeout)  # its device on loopback / this node's address


class NcclTransport(BucketTransport):
    """GPU, engines apart from the policy."""

    name, needs_cuda, device = "nccl", True, "cuda"

    @staticmethod
    def make_group(store: Any, rank: int, size: int, timeout: Any) -> Any:
        opts = torch.distributed.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return torch.distributed.ProcessGroupNCCL(store, rank, size, opts)


class CudaIpcTransport(BucketTransport):
    """GPU, colocated: the source shares each bucket by CUDA IPC handle; receivers map it, load and
    acknowledge before the copy is reused."""

    name, needs_cuda, device, num_buffers = "cuda_ipc", True, "cuda", 1

    def send_bucket(self, out: Outbox, buf: torch.Tensor, meta: BucketMeta) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        if meta.index >= 2:
            self._wait_acks(out, meta.index - 2)  # that copy is free again
        own = buf.clone()
        out.shared = (out.shared + [own])[-2:]
        torch.cuda.current_stream().synchronize()
        out.ch.publish(out.key(f"b{meta.index}"), (meta, reduce_tensor(own)))

    def finish(self, out: Outbox) -> None:
        out.ch.publish(out.key(f"b{out.sent}"), END)
        self._wait_acks(out, out.sent - 1)

    def receive_bucket(self, ch: Channel, session: SyncSession, item: Any) -> tuple[torch.Tensor, BucketMeta]:
        meta, (rebuild, args) = item
        buf = rebuild(*args)
        device = self._device()
        return (buf if buf.device == device else buf.to(device)), meta

    def received(self, ch: Channel, session: SyncSession, stage: int, index: int, rank: int) -> None:
        torch.cuda.current_stream().synchronize()
        key = session.key(stage, f"ack{index}/r{rank}")
        ch.set_flag(key)
        self.remember(session, rank, key)

    @staticmethod
    def _wait_acks(out: Outbox, index: int) -> None:
        if index >= 0:
            keys = [out.key(f"ack{index}/r{r}") for r in range(1, 1 + out.session.num_receivers)]
            out.ch.wait_flags(keys)


def _wait(out: Outbox) -> None:
    """Wait for the broadcast in flight, if any."""
    if out.work is not None:
        work, out.work = out.work, None
        work.wait(out.ch.timeout)


def _timed(it: Iterable[Any], clock: dict[str, float], key: str) -> Iterator[Any]:
    """`it`, adding the time spent producing each item to clock[key]."""
    it, done = iter(it), object()
    while True:
        t = time.perf_counter()
        item = next(it, done)
        clock[key] += time.perf_counter() - t
        if item is done:
            return
        yield item
