"""`Worker`: the base class of every actor in a `WorkerGroup`.

It knows its role, rank and parallel layout, writes its log to a file the group can tail, joins the
group's torch.distributed world (`init_distributed`, overridden by the Megatron workers) and then runs
the subclass's `setup()`. Methods exposed on the group are declared with `workers.dispatch.register`.
"""

from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("workers")


@dataclass(frozen=True)
class WorkerContext:
    """What a rank is told at creation."""

    role: str
    name: str  # e.g. "policy/dp0-tp1-pp0"
    rank: int
    world_size: int
    tp: int
    pp: int
    dp: int
    log_path: str
    cp: int = 1  # context-parallel ranks per sequence (world = tp * cp * pp * dp)
    timeout_s: float = 300.0  # collective timeout
    backend: str | None = None  # None: gloo without CUDA, nccl with it
    seed: int = 1234
    num_threads: int | None = None  # torch intra-op threads (None: leave torch's default)
    niceness: int | None = 0  # CPU priority of the rank (Ray starts workers at nice 15); None: leave it


def layout_of(rank: int, tp: int, pp: int, dp: int, cp: int = 1) -> tuple[int, int, int]:
    """(dp_rank, tp_rank, pp_rank) of a global rank in megatron-core's default order (tp fastest, then cp,
    dp, pp slowest)."""
    return (rank // (tp * cp)) % dp, rank % tp, rank // (tp * cp * dp)


def cp_rank_of(rank: int, tp: int, cp: int) -> int:
    """The context-parallel rank of a global rank (see `layout_of`)."""
    return (rank // tp) % cp


def redirect_output(path: str | Path) -> Any:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so C++ and library output too)
    to the log file at `path` and return it, line-buffered. For actors only: the driver's console then
    shows the run's own progress, and each rank's chatter (megatron, vLLM, warnings) stays in its log."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the actor
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(file.fileno(), 1)
    os.dup2(file.fileno(), 2)
    faulthandler.enable(file=file, all_threads=True)
    return file


def node_ip() -> str:
    """The Ray node address of this process ("?" outside Ray)."""
    try:
        import ray

        return ray.util.get_node_ip_address() if ray.is_initialized() else "?"
    except Exception:  # noqa: BLE001 - not in a Ray worker
        return "?"


def placement() -> str:
    """"placement group <id>" of this Ray actor (colocated roles share one), or "no placement group"."""
    try:
        import ray

        pg = ray.get_runtime_context().get_placement_group_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - not in a Ray worker
        pg = None
    return f"placement group {pg}" if pg else "no placement group"


class Worker:
    """Base actor. Subclasses override `init_distributed` (world set-up) and `setup` (build models)."""

    def __init__(self, ctx: WorkerContext, **init_kwargs: Any) -> None:
        self.ctx = ctx
        self.init_kwargs = init_kwargs
        self.dp_rank, self.tp_rank, self.pp_rank = layout_of(ctx.rank, ctx.tp, ctx.pp, ctx.dp, ctx.cp)
        self.cp_rank = cp_rank_of(ctx.rank, ctx.tp, ctx.cp)
        self._setup_logging()
        if ctx.niceness is not None:
            set_niceness(ctx.niceness)
        if ctx.num_threads:
            import torch

            torch.set_num_threads(ctx.num_threads)
        log.info("%s started: pid %d on %s, node %s (%s)", ctx.name, os.getpid(), socket.gethostname(),
                 node_ip(), placement())

    def __repr__(self) -> str:  # Ray prefixes this actor's log lines with it
        return self.ctx.name

    # ---- layout -------------------------------------------------------------------------------
    @property
    def is_output_rank(self) -> bool:
        """The rank whose results a DP_COMPUTE call returns: last PP stage, TP and CP rank 0."""
        return self.tp_rank == 0 and self.cp_rank == 0 and self.pp_rank == self.ctx.pp - 1

    def rank_info(self) -> dict[str, Any]:
        """Where this rank runs and what it is (used by the group for dispatch and error messages)."""
        import ray

        return {
            "name": self.ctx.name,
            "rank": self.ctx.rank,
            "dp_rank": self.dp_rank,
            "tp_rank": self.tp_rank,
            "pp_rank": self.pp_rank,
            "cp_rank": self.cp_rank,
            "is_output": self.is_output_rank,
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "log_path": self.ctx.log_path,
        }

    def free_port(self, host: str) -> int:
        """A free TCP port on `host` (rank 0 picks the rendezvous port)."""
        from workers.net import free_port

        return free_port(host)

    # ---- world --------------------------------------------------------------------------------
    def init_world(self, master_addr: str, master_port: int) -> dict[str, Any]:
        """Join the torch.distributed world, then `setup()`; returns `rank_info()` (actual layout)."""
        t0 = time.monotonic()
        self._run_method(lambda s: s.init_distributed(master_addr, master_port), (), {})
        log.info("%s joined the world at %s:%d in %.1fs", self.ctx.name, master_addr, master_port,
                 time.monotonic() - t0)
        self._run_method(lambda s: s.setup(), (), {})
        log.info("%s set up in %.1fs", self.ctx.name, time.monotonic() - t0)
        return self.rank_info()

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        """Plain torch.distributed world (no megatron); the Megatron workers override this."""
        import torch

        from workers.net import init_world

        backend = self.ctx.backend or ("nccl" if torch.cuda.is_available() else "gloo")
        init_world(backend, master_addr, master_port, self.ctx.rank, self.ctx.world_size,
                   datetime.timedelta(seconds=self.ctx.timeout_s))

    def setup(self) -> None:
        """Build models etc. from `self.init_kwargs`; runs after the world is up."""

    # ---- running methods ----------------------------------------------------------------------
    def _run_method(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        """Run `fn(self, *args, **kwargs)` with the per-call context; log the traceback of a failure."""
        name = getattr(fn, "__name__", "call")
        t0 = time.monotonic()
        try:
            with self.call_context():
                out = fn(self, *args, **kwargs)
        except BaseException:
            log.error("%s.%s failed:\n%s", self.ctx.name, name, traceback.format_exc())
            raise
        log.debug("%s.%s took %.3fs", self.ctx.name, name, time.monotonic() - t0)
        return out

    def call_context(self):
        """Context entered around every method call (the Megatron workers enter the CPU device mode)."""
        import contextlib

        return contextlib.nullcontext()

    def _setup_logging(self) -> None:
        self._log_file = redirect_output(self.ctx.log_path)
        handler = logging.StreamHandler(self._log_file)
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [{self.ctx.name}] %(name)s: %(message)s"))
        root = logging.getLogger()
        root.addHandler(handler)
        root.setLevel(logging.INFO)


def set_niceness(value: int) -> None:
    """Set the nice value of every thread of this process (Linux niceness is per thread; threads created
    later inherit it from their creator). Ray starts worker processes at nice 15, which on a shared
    machine starves the ranks that do the training; lowering it needs CAP_SYS_NICE (root), otherwise a
    warning is logged and the value is left alone."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    try:
        for tid in tids:
            os.setpriority(os.PRIO_PROCESS, tid, value)
    except (PermissionError, ProcessLookupError, OSError) as e:
        log.warning("could not set the nice value to %d (%s); the rank keeps nice %d", value, e, os.nice(0))


def tail_file(path: str | Path, lines: int = 30) -> str:
    """The last `lines` lines of a text file ('' if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])
