"""The control plane of weight sync: a TCPStore hosted by rollout engine 0, and each participant's channel.

Every transport publishes its small messages (bucket metas, CUDA IPC handles, "done" flags) in the store
under per-sync keys; receivers block on them with the sync timeout. A channel may also carry a process
group (gloo, NCCL) built over the same store, made by the transport that owns the channel.

The store listens on loopback (on one node) or this node's address (several nodes), never on every
interface (workers/net.py), and its values are signed JSON (wire.py), never pickles.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch

from workers.net import node_address, serve_store
from workers.rollout import wire

# (prefix store, rank, size, timeout) -> a process group, or None for transports without one
GroupFactory = Callable[[Any, int, int, datetime.timedelta], Any]


class SyncEndpoint:
    """The control store, hosted in rollout engine 0's process for the life of the engine."""

    def __init__(self, store: Any, host: str, port: int) -> None:
        self.store, self.host, self.port = store, host, port

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    @classmethod
    def open(cls, host: str | None = None) -> SyncEndpoint:
        host = host or node_address()
        store = serve_store(host)  # on `host` only: TCPStore on its own binds every interface
        return cls(store, host, store.port)


class Channel:
    """One participant's view of one pipeline stage's transfer: the store and (lazily) the process group.

    Rank 0 is the stage's source; receivers are 1..num_receivers. Transports cache their channels and
    reuse them in later syncs over the same channel name.
    """

    def __init__(self, host: str, port: int, name: str, stage: int, rank: int, size: int, timeout_s: float,
                 make_group: GroupFactory | None = None, secret: str = "") -> None:
        self.stage, self.rank, self.size = stage, rank, size
        self.secret = secret  # signs and checks every value this channel publishes or fetches (wire.py)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = torch.distributed.TCPStore(host, port, None, False, timeout=self.timeout)
        self.prefix = f"chan{name}/stage{stage}"
        self._make_group = make_group
        self._pg: Any = None
        self.pack_buffers: list[torch.Tensor] = []  # the source's bucket buffers, kept between syncs

    def set_timeout(self, timeout_s: float) -> None:
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store.set_timeout(self.timeout)

    @property
    def pg(self) -> Any:
        if self._pg is None and self._make_group is not None:
            store = torch.distributed.PrefixStore(self.prefix, self.store)
            self._pg = self._make_group(store, self.rank, self.size, self.timeout)
        return self._pg

    def publish(self, key: str, obj: Any) -> None:
        """Store `obj` (a type wire.py knows) under `key`, signed with the session secret."""
        self.store.set(key, wire.encode(key, obj, self.secret))

    def fetch(self, key: str) -> Any:
        """Wait for `key` (up to the timeout), check its signature, decode it."""
        return wire.decode(key, self.store.get(key), self.secret)

    def set_flag(self, key: str) -> None:
        self.publish(key, True)

    def wait_flags(self, keys: list[str]) -> None:
        """Wait until every flag in `keys` is set, and check that each was set by the run's own processes."""
        self.store.wait(keys, self.timeout)
        for key in keys:
            self.fetch(key)

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
