"""The weight-sync transports by name (`rollout.sync_transport`), and the one place one is chosen."""

from __future__ import annotations

from collections.abc import Callable

from workers.rollout.cpu.shm import ShmTransport
from workers.rollout.transport import Transport
from workers.rollout.weight_sync import CudaIpcTransport, GlooTransport, NcclTransport

TRANSPORTS: dict[str, type[Transport]] = {t.name: t for t in (ShmTransport, GlooTransport, NcclTransport,
                                                             CudaIpcTransport)}


def choose_transport(on_gpu: bool, colocated: bool, override: str | None = None,
                     same_host: bool | Callable[[bool], bool] = False, nodes: int = 1) -> type[Transport]:
    """CPU: "shm" when every policy rank and engine share one host with room in /dev/shm (`same_host`),
    else "gloo". GPU: CUDA IPC when colocated, else NCCL. `override` (SyncConfig.sync_transport) picks one by
    name; "gloo" keeps memory bounded to a few buckets. `same_host` may be a check, called (only when
    "shm" is a candidate) with strict=True when it was named, so that it raises with its reason. `nodes`: how
    many nodes the policy ranks and engines are on; colocated engines on GPUs across nodes are refused (CUDA
    IPC handles work within one node, and NCCL cannot join two processes that share one GPU)."""

    def fits(strict: bool) -> bool:
        return same_host(strict) if callable(same_host) else bool(same_host)

    if override:
        cls = TRANSPORTS.get(override)
        if cls is None:
            raise ValueError(f"unknown weight-sync transport {override!r}; known: {tuple(TRANSPORTS)}")
        if cls.needs_cuda and not on_gpu:
            raise ValueError(f"transport {override!r} needs CUDA; this machine has none (use 'shm' or 'gloo')")
        if cls.one_host and not fits(strict=True):
            raise ValueError(f"transport {override!r} needs the policy and every engine on one host with room in "
                             f"/dev/shm for the model (use 'gloo')")
        return cls
    if not on_gpu:
        return ShmTransport if fits(strict=False) else GlooTransport
    if colocated and nodes > 1:
        raise ValueError(f"rollout.colocate_with=policy on GPUs needs the policy and its engines on one node, not "
                         f"{nodes} (CUDA IPC works within a node); place the engines apart (rollout.colocate_with="
                         f"null) to sync over NCCL")
    return CudaIpcTransport if colocated else NcclTransport
