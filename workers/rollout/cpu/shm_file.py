"""The shared file of the "shm" transport: where each HF tensor lives in it, and the mappings of it.

One file under /dev/shm (tmpfs, i.e. memory) holds every HF tensor of the model in the engine's dtype, at
offsets fixed by the HF config (`ShmLayout`). It lives as long as the driver's `WeightSyncer` and is
reused by every sync, and each process keeps its mapping, so after the first sync no page is faulted or
zero-filled again. Files are named `rlhf-wsync-<driver pid>-<id>.bin`; the driver removes its file when
the syncer is closed, collected or the interpreter exits, and removes files left by drivers that died
before creating a new one.
"""

from __future__ import annotations

import glob
import os
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from workers.dtypes import as_dtype

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
        item = as_dtype(dtype).itemsize
        out = cls(str(as_dtype(dtype)).replace("torch.", ""))
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
        dt = as_dtype(self.dtype)
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
        if pid != os.getpid() and not pid_alive(pid):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (on this host)."""
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
