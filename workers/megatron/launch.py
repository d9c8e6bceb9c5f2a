"""Launch a function on N local ranks with torch.distributed + megatron parallel_state initialised.

Used by the offline converter (`rlhf convert`), tests and benchmarks: `run_distributed(fn, world_size,
tp=, pp=, ep=, cp=)` spawns processes on 127.0.0.1 with a free port, calls `fn(*args)` on every rank after
`init_distributed` (inside the CPU device mode on CPU), and returns the per-rank results (index = global
rank). `fn` must be importable (module level), and the calling script needs an `if __name__ ==
"__main__":` guard.

The ranks are forked from a fork server (multiprocessing's `forkserver`), started once per calling process with
torch, megatron-core and transformers imported (workers/megatron/rank_preload.py): a rank starts in a fraction
of a second instead of importing them again. The server holds no threads and no process group; each rank gets
the caller's environment as it is at the call (the server's is from its start) and sys.path as a spawned
process would.
"""

from __future__ import annotations

import os
import pickle
import queue
import traceback
from collections.abc import Callable
from typing import Any

from workers.file_problems import FileProblem
from workers.net import LOOPBACK, free_port

PRELOAD = "workers.megatron.rank_preload"


class DistributedError(RuntimeError):
    """A rank raised; the message carries that rank's traceback."""


def _worker(
    rank: int,
    world_size: int,
    port: int,
    tp: int,
    pp: int,
    ep: int,
    cp: int,
    threads: int,
    fn: Callable,
    args: tuple,
    results: Any,
    env: dict[str, str],
) -> None:
    try:
        os.environ.clear()
        os.environ.update(env)
        import torch

        torch.set_num_threads(threads)
        from workers.megatron.cpu_compat import cpu_device_mode
        from workers.megatron.dist_setup import destroy_distributed, init_distributed

        with cpu_device_mode():
            init_distributed(rank, world_size, LOOPBACK, port, tp=tp, pp=pp, ep=ep, cp=cp)
            try:
                out = fn(*args)
            finally:
                destroy_distributed()
        # Plain pickle: tensors travel by value, on the CPU, not as shared-memory or CUDA handles that die
        # with this process.
        from torch.utils._pytree import tree_map

        out = tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, out)
        results.put((rank, True, pickle.dumps(out)))
    except FileProblem as e:  # a full disk, read-only folder or truncated file: re-raised as such by the parent
        results.put((rank, False, (e.path, e.cause)))
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
        results.put((rank, False, traceback.format_exc()))


def run_distributed(
    fn: Callable,
    world_size: int,
    args: tuple = (),
    tp: int = 1,
    pp: int = 1,
    timeout_s: float = 300.0,
    threads: int | None = None,
    ep: int = 1,
    cp: int = 1,
) -> list[Any]:
    """Run `fn(*args)` on `world_size` spawned ranks (TP `tp`, context-parallel `cp`, PP `pp`, DP the rest,
    expert-parallel `ep` out of DP); return results by rank.

    Raises DistributedError with the failing rank's traceback if any rank raises (a FileProblem as itself),
    and TimeoutError (after killing the ranks) if they do not all finish within `timeout_s`. Results must
    be picklable.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([PRELOAD])  # read when the server starts: the first call in this process
    results = ctx.Queue()
    port = free_port()
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, tp, pp, ep, cp, threads, fn, args, results, env),
                    daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    try:
        import time

        deadline = time.monotonic() + timeout_s
        while len(out) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(out))} did not finish in {timeout_s}s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in out]
                if dead:
                    raise DistributedError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode}") from None
                continue
            if not ok and isinstance(value, tuple):
                raise FileProblem(*value)
            if not ok:
                raise DistributedError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [out[r] for r in range(world_size)]
