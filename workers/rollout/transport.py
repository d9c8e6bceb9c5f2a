"""The `Transport` interface of weight sync, the `SyncSession` it works on, and its errors.

A transport moves the policy's weights into the rollout engines in three parts:
- driver (`WeightSyncer`, one instance per syncer): `check` the sync config, add its `session_fields`
  to every `SyncSession`, `close` what it holds (the shm file);
- policy (`send`, on every policy rank, from `send_weights_to_rollout`);
- engine (`receive`, on each vLLM worker through `receive_on_vllm_worker`).
Senders and receivers use the process's own instance (`local()`), which owns the process's channels to
the control store (control.py) and the control keys it deletes at the next sync.

The transports (registry.py chooses one): "gloo", "nccl", "cuda_ipc" (weight_sync.py, bucketed) and
"shm" (cpu/shm.py, one shared file). Every wait is bounded by the session's `timeout_s`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from workers.rollout.control import Channel, GroupFactory
from workers.rollout.digest import DIGEST_STRIDE
from workers.rollout.sync_errors import WeightSyncError, WeightSyncTimeout

if TYPE_CHECKING:
    from workers.rollout.config import SyncConfig


def is_timeout(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return isinstance(exc, TimeoutError) or "timeout" in text or "timed out" in text


def sync_error(exc: BaseException, where: str, timed_out: bool | None = None) -> WeightSyncError:
    """"weight sync timed out|failed: <where>: <exc>" as a WeightSyncTimeout or WeightSyncError."""
    timed_out = is_timeout(exc) if timed_out is None else timed_out
    cls = WeightSyncTimeout if timed_out else WeightSyncError
    return cls(f"weight sync {'timed out' if timed_out else 'failed'}: {where}: {exc}")


@dataclass
class SyncSession:
    """Everything the senders and receivers of one sync need (picklable; built by the driver)."""

    sync_id: int
    transport: type[Transport]  # pickled by reference; each process works with its `local()` instance
    host: str
    port: int
    num_receivers: int
    source_ranks: list[int]  # global policy rank that sends pipeline stage s
    channel: str = "0"  # names the process groups; unique per (policy, engines) pair, renewed after a failure
    bucket_bytes: int = 64 << 20
    dtype: str = "float32"
    timeout_s: float = 60.0
    writer_ranks: list[int] = field(default_factory=list)  # shm: the policy ranks that write (DP replica 0)
    shm_path: str = ""  # shm: the shared file, reused by every sync of one syncer
    direct_load: bool = True  # shm: engines install recognised models module by module (engine_ops.load_direct)
    zero_copy: bool = False  # shm: engines compute straight from the file (engine_ops.share_weights)
    secret: str = ""  # signs the control messages (wire.py); one per syncer, sent to the run's processes by Ray
    digest: bool = False  # rollout.verify_digest: senders and engines return per-tensor digests (digest.py)
    digest_stride: int = DIGEST_STRIDE  # the digests sample 1/digest_stride of a 2-D tensor's rows (digest.py)

    @property
    def num_stages(self) -> int:
        return len(self.source_ranks)

    def key(self, stage: int, what: str) -> str:
        return f"sync{self.sync_id}/stage{stage}/{what}"


class Transport:
    """One way of moving weights from the policy ranks into the engines (see the module docstring)."""

    name: ClassVar[str] = ""
    needs_cuda: ClassVar[bool] = False
    one_host: ClassVar[bool] = False  # needs the policy and every engine on one host
    supports_zero_copy: ClassVar[bool] = False
    make_group: ClassVar[GroupFactory | None] = None  # the process group of each channel, if any
    _locals: ClassVar[dict[type, Transport]] = {}

    def __init__(self) -> None:
        self._channels: dict[tuple, Channel] = {}
        self._old_keys: dict[tuple, list[str]] = {}

    @classmethod
    def local(cls) -> Transport:
        """This process's sending / receiving instance of the transport (kept across syncs)."""
        inst = Transport._locals.get(cls)
        if inst is None:
            inst = Transport._locals[cls] = cls()
        return inst

    # ---- driver side ---------------------------------------------------------------------------
    def check(self, cfg: SyncConfig) -> None:
        """Reject a `SyncConfig` this transport cannot serve."""
        if cfg.zero_copy_weights and not self.supports_zero_copy:
            raise ValueError(f"zero-copy weights (rollout.zero_copy_weights) need the 'shm' transport (CPU, the "
                             f"policy and every engine on one host); this sync uses {self.name!r}")

    def session_fields(self, syncer: Any) -> dict[str, Any]:
        """The transport's own `SyncSession` fields for a sync of `syncer`."""
        return {}

    def close(self) -> None:
        """Release what the driver side holds."""

    # ---- policy and engine sides ---------------------------------------------------------------
    def send(self, worker: Any, session: SyncSession) -> dict[str, Any]:
        """Policy side; every policy rank calls it with its worker. Returns stats."""
        raise NotImplementedError

    def receive(self, vworker: Any, session: SyncSession, engine_rank: int, tp: int) -> dict[str, Any]:
        """Engine side, on one vLLM worker: load the new weights in place. Returns stats."""
        raise NotImplementedError

    # ---- this process's channels and control keys ----------------------------------------------
    def channel(self, session: SyncSession, stage: int, rank: int) -> Channel:
        """The cached channel of this process for (endpoint, channel name, stage, rank)."""
        key = (session.host, session.port, session.channel, stage, rank)
        ch = self._channels.get(key)
        if ch is None:
            ch = self._channels[key] = Channel(session.host, session.port, session.channel, stage, rank,
                                               1 + session.num_receivers, session.timeout_s, self.make_group,
                                               session.secret)
        ch.set_timeout(session.timeout_s)
        return ch

    def drop(self, session: SyncSession) -> None:
        """Forget this process's channels of the session's endpoint (after a failure)."""
        for key in [k for k in self._channels if k[:2] == (session.host, session.port)]:
            self._channels.pop(key).close()

    def remember(self, session: SyncSession, rank: int, *keys: str) -> None:
        """Control keys this receiver deletes at its next sync (when every participant of this one is done),
        so the store does not grow with the number of steps."""
        self._old_keys.setdefault((session.host, session.port, rank), []).extend(keys)

    def forget_old_keys(self, session: SyncSession, rank: int) -> None:
        keys = self._old_keys.pop((session.host, session.port, rank), [])
        if not keys:
            return
        store = self.channel(session, 0, rank).store
        for key in keys:
            try:
                store.delete_key(key)
            except Exception:  # noqa: BLE001 - another receiver deleted it first
                pass

    @staticmethod
    def sync_rank(vworker: Any, engine_rank: int, tp: int) -> int:
        """The receiver's rank in the channels: 1 + its index over all engines' vLLM workers."""
        return 1 + engine_rank * tp + int(getattr(vworker, "rank", 0))


def receive_on_vllm_worker(vworker: Any, session: SyncSession, engine_rank: int, tp: int) -> dict[str, Any]:
    """Runs on each vLLM worker (`LLM.collective_rpc`): the session's transport receives there, then (with
    `session.digest`) the worker digests what it now holds (engine_digest.py)."""
    stats = session.transport.local().receive(vworker, session, engine_rank, tp)
    if session.digest:
        from workers.rollout.engine_digest import held_digests

        stats["digests"] = held_digests(vworker, engine_rank, session.digest_stride, session.sync_id)
    return stats
