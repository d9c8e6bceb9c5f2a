"""Transports of weight sync: a control store plus a data channel, chosen in one place.

Control: a `torch.distributed.TCPStore` hosted by rollout engine 0 (`SyncEndpoint`). Each bucket's
`BucketMeta` (and, for CUDA IPC, the memory handle) is published under a per-sync key; receivers block
on it with the sync timeout.
Data, by `choose_transport`:
- "shm" (CPU, every policy rank and engine on one host; the CPU default there): the policy ranks write
  their own TP shards straight into a shared file under /dev/shm that holds the whole model in the
  engine's dtype, and the engines load views of it (see shm.py). No TP gather, no copy in transit; the
  file costs the model's bytes of memory for the life of the syncer. Only tested on CPU (on GPU it may
  be named explicitly, but CUDA IPC / NCCL are the defaults there).
- "gloo" (CPU, bounded memory or several hosts): one stateless `ProcessGroupGloo` per pipeline stage over
  {stage source rank, receivers}; the source broadcasts each bucket (measured here: 64 MB in ~0.02 s; the
  Ray object store took ~0.045 s just to `ray.put` the same bytes).
- "nccl" (GPU, engines apart from the policy): the same with `ProcessGroupNCCL`.
- "cuda_ipc" (GPU, colocated): the source publishes a CUDA IPC handle of its bucket buffer; receivers
  map it, load, and acknowledge before the buffer is reused.
Every wait (store get, collective, acknowledgement) is bounded by the session's `timeout_s`.
"""

from __future__ import annotations

import datetime
import pickle
import socket
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.group.errors import WorkerGroupError, WorkerTimeoutError

TRANSPORTS = ("shm", "gloo", "nccl", "cuda_ipc")


class WeightSyncError(WorkerGroupError):
    """A weight sync failed; the message names the rollout and policy ranks involved."""


class WeightSyncTimeout(WeightSyncError, WorkerTimeoutError):
    """A weight sync transfer did not complete within its timeout."""


def choose_transport(on_gpu: bool, colocated: bool, override: str | None = None, same_host: bool = False) -> str:
    """The one place the transport is chosen. CPU: "shm" when every policy rank and engine share one host
    with room in /dev/shm (`same_host`), else "gloo". GPU: CUDA IPC when colocated, else NCCL.
    `override` (SyncConfig.transport) picks one by name; "gloo" keeps memory bounded to a few buckets."""
    if override:
        if override not in TRANSPORTS:
            raise ValueError(f"unknown weight-sync transport {override!r}; known: {TRANSPORTS}")
        if override in ("nccl", "cuda_ipc") and not on_gpu:
            raise ValueError(f"transport {override!r} needs CUDA; this machine has none (use 'shm' or 'gloo')")
        if override == "shm" and not same_host:
            raise ValueError("transport 'shm' needs the policy and every engine on one host with room in /dev/shm "
                             "for the model (use 'gloo')")
        return override
    if not on_gpu:
        return "shm" if same_host else "gloo"
    return "cuda_ipc" if colocated else "nccl"


@dataclass
class SyncSession:
    """Everything the senders and receivers of one sync need (picklable; built by the driver)."""

    sync_id: int
    transport: str
    host: str
    port: int
    num_receivers: int
    source_ranks: list[int]  # global policy rank that sends pipeline stage s
    channel: str = "0"  # names the process groups; unique per (policy, engines) pair, renewed after a failure
    bucket_bytes: int = 64 << 20
    dtype: str = "float32"
    timeout_s: float = 60.0
    stall_s: float = 0.0  # test hook: the stage-0 source stalls this long before its bucket `stall_bucket`
    # (shm: before writing anything)
    stall_bucket: int = 1
    writer_ranks: list[int] = field(default_factory=list)  # shm: the policy ranks that write (DP replica 0)
    shm_path: str = ""  # shm: the shared file, reused by every sync of one syncer
    direct_load: bool = True  # shm: engines install recognised models module by module (engine_ops.load_direct)
    zero_copy: bool = False  # shm: engines compute straight from the file (engine_ops.share_weights)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.source_ranks)

    def key(self, stage: int, what: str) -> str:
        return f"sync{self.sync_id}/stage{stage}/{what}"


class SyncEndpoint:
    """The control store, hosted in rollout engine 0's process for the life of the engine."""

    def __init__(self, store: Any, host: str, port: int) -> None:
        self.store, self.host, self.port = store, host, port

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    @classmethod
    def open(cls, host: str | None = None) -> SyncEndpoint:
        host = host or _node_ip()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        store = torch.distributed.TCPStore(host, port, None, True, timeout=datetime.timedelta(seconds=60),
                                           wait_for_workers=False)
        return cls(store, host, port)


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            ip = ray.util.get_node_ip_address()
            if ip and not ip.startswith("127.") and _is_multi_node():
                return ip
    except Exception:  # noqa: BLE001 - no Ray, or not in a cluster: loopback
        pass
    return "127.0.0.1"


def _is_multi_node() -> bool:
    import ray

    return len([n for n in ray.nodes() if n.get("Alive")]) > 1


class Channel:
    """One participant's view of one pipeline stage's transfer: the store and (lazily) the process group.

    Rank 0 is the stage's source; receivers are 1..num_receivers. Channels are cached per process and
    reused by later syncs of the same generation.
    """

    def __init__(self, session: SyncSession, stage: int, rank: int) -> None:
        self.stage, self.rank, self.transport = stage, rank, session.transport
        self.timeout = datetime.timedelta(seconds=session.timeout_s)
        self.store = torch.distributed.TCPStore(session.host, session.port, None, False, timeout=self.timeout)
        self.size = 1 + session.num_receivers
        self.prefix = f"chan{session.channel}/stage{stage}"
        self._pg: Any = None
        self.pack_buffers: list[torch.Tensor] = []  # the source's bucket buffers, kept between syncs

    def set_timeout(self, timeout_s: float) -> None:
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store.set_timeout(self.timeout)

    @property
    def pg(self) -> Any:
        if self._pg is None and self.transport in ("gloo", "nccl"):
            store = torch.distributed.PrefixStore(self.prefix, self.store)
            if self.transport == "gloo":
                self._pg = torch.distributed.ProcessGroupGloo(store, self.rank, self.size, self.timeout)
            else:
                opts = torch.distributed.ProcessGroupNCCL.Options()
                opts._timeout = self.timeout
                self._pg = torch.distributed.ProcessGroupNCCL(store, self.rank, self.size, opts)
        return self._pg

    def publish(self, key: str, obj: Any) -> None:
        self.store.set(key, pickle.dumps(obj))

    def fetch(self, key: str) -> Any:
        return pickle.loads(self.store.get(key))

    def broadcast_async(self, tensor: torch.Tensor) -> Any:
        """Start broadcasting `tensor` from rank 0; returns the work (`.wait(timeout)`)."""
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = self.timeout
        return self.pg.broadcast([tensor], opts)

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.broadcast_async(tensor).wait(self.timeout)

    def close(self) -> None:
        self._pg = None
        self.store = None


_CHANNELS: dict[tuple, Channel] = {}


def get_channel(session: SyncSession, stage: int, rank: int) -> Channel:
    """The cached channel of this process for (endpoint, channel, stage, rank)."""
    key = (session.host, session.port, session.channel, stage, rank, session.transport)
    ch = _CHANNELS.get(key)
    if ch is None:
        ch = _CHANNELS[key] = Channel(session, stage, rank)
    ch.set_timeout(session.timeout_s)
    return ch


def drop_channels(session: SyncSession) -> None:
    """Forget this process's channels of the session's endpoint (after a failure)."""
    for key in [k for k in _CHANNELS if k[:2] == (session.host, session.port)]:
        _CHANNELS.pop(key).close()


def is_timeout(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return isinstance(exc, TimeoutError) or "timeout" in text or "timed out" in text


# ---- CUDA IPC helpers (GPU, colocated) -------------------------------------------------------------
def ipc_handle(tensor: torch.Tensor) -> Any:
    """A picklable handle that another process on the same node can map (`from_ipc_handle`)."""
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(tensor)


def from_ipc_handle(handle: Any, device: torch.device | None = None) -> torch.Tensor:
    fn, args = handle
    args = list(args)
    if device is not None and len(args) > 6:
        args[6] = device.index  # rebuild on the receiver's device id when the policy sees a different one
    return fn(*args)
