"""torch.distributed + megatron-core parallel_state set-up and tear-down (gloo on CPU, nccl on GPU)."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch

from workers.megatron.cpu_compat import apply_cpu_compat, cuda_absent
from workers.net import LOOPBACK, init_world


def default_backend() -> str:
    """The process-group backend for this machine: 'nccl' with CUDA, 'gloo' without (the one CPU/GPU branch)."""
    return "gloo" if cuda_absent() else "nccl"


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str = LOOPBACK,
    master_port: int = 29500,
    tp: int = 1,
    pp: int = 1,
    backend: str | None = None,
    timeout_s: float = 300.0,
    seed: int = 1234,
    ep: int = 1,
    cp: int = 1,
) -> None:
    """Initialise torch.distributed and megatron parallel_state (TP, CP, PP given; DP = world / (TP*CP*PP)).

    `cp` is the context-parallel size (`workers.megatron.context_parallel`; ranks in megatron's order,
    tp fastest, then cp, dp, pp). `ep` is the expert-parallel size; expert layers keep TP as their tensor-parallel size, so megatron
    needs world % (TP*EP*PP) == 0, i.e. EP divides DP (see `ep_fit_error`).

    On CPU applies the compatibility layer first (and enters its device mode in this thread). Seeds the
    megatron RNG tracker with `model_parallel_cuda_manual_seed(seed)`. Raises ValueError when the world
    size is not a multiple of tp*cp*pp.
    """
    if min(tp, pp, cp) < 1:
        raise ValueError(f"tp, cp and pp must be >= 1, got tp={tp} cp={cp} pp={pp}")
    if world_size % (tp * cp * pp) != 0:
        raise ValueError(f"world size {world_size} is not divisible by tp*cp*pp = {tp}*{cp}*{pp}")
    err = ep_fit_error(world_size, tp, pp, ep)
    if err:
        raise ValueError(err)
    apply_cpu_compat()
    from megatron.core import parallel_state, tensor_parallel

    backend = backend or default_backend()
    if not torch.distributed.is_initialized():
        if backend == "nccl":
            local_rank = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
            torch.cuda.set_device(local_rank)
        init_world(backend, master_addr, master_port, rank, world_size, datetime.timedelta(seconds=timeout_s))
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        distributed_timeout_minutes=max(1, int(timeout_s // 60)),
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def ep_fit_error(world_size: int, tp: int, pp: int, ep: int) -> str | None:
    """Why expert parallelism `ep` does not fit this world, or None. megatron-core 0.16.1 lays expert
    layers out as expert-TP (= TP) x EP x expert-DP x PP over the same ranks, so world_size must be a
    multiple of TP*EP*PP: EP splits the data-parallel ranks (DP = world / (TP*PP))."""
    if ep < 1:
        return f"ep must be >= 1, got {ep}"
    if world_size % (tp * ep * pp):
        dp = world_size // (tp * pp) if world_size % (tp * pp) == 0 else world_size / (tp * pp)
        return (f"expert parallel size {ep} does not divide the data-parallel size: world {world_size} = "
                f"tp {tp} x pp {pp} x dp {dp}, and megatron needs world % (tp*ep*pp) = "
                f"{world_size} % {tp * ep * pp} == 0")
    return None


def destroy_distributed() -> None:
    """Tear down megatron parallel_state and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def tp_layout() -> tuple[int, int, Any]:
    """(rank, size, group) of this rank's tensor-parallel group."""
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(), \
        ps.get_tensor_model_parallel_group()
