"""Run megatron-core 0.16.1 on CPU over gloo: the patches for its CUDA assumptions, only without CUDA.

Written against megatron-core 0.16.1's internals (`tensor_parallel.random`); `apply_cpu_compat()` raises
on any other installed version rather than patching code it was not checked against. With CUDA nothing
here does anything.

Scope, in two parts:
- Process-wide, once: `apply_cpu_compat()`, called only by `workers.megatron.dist_setup.init_distributed`
  (every process that runs megatron goes through it; repeated calls do nothing).
  - `torch.cuda.current_device()` (~100 call sites, used as a `device=`) returns the CPU device;
    `torch.cuda.synchronize()` is a no-op; `torch.cuda.manual_seed()` seeds the CPU generator.
  - `tensor_parallel.random._get_cuda_rng_state` / `_set_cuda_rng_state` use the CPU generator, and
    `CudaRNGStatesTracker.add` / `.fork` are CPU-generator versions with the same semantics (the
    originals seed the CUDA generator and warn whenever the CPU one moves inside a fork).
  - Also without Transformer Engine (CPU or GPU): `moe_utils.te_general_gemm` bound to None, and
    `multi_latent_attention.HAVE_TE` set False (see `_define_te_general_gemm`, `_mla_without_te`).
  - On any device: the expert-bias token count with a padding mask (`_fix_expert_bias_padding`), and an
    in-process queue for a synchronous checkpoint save's results (`_in_process_save_results`).
- Per block of code: `cpu_device_mode()`, a TorchFunctionMode entered for the duration of a `with`
  (TorchFunctionModes are thread-local). The Megatron workers enter it around every actor method
  (`MegatronWorker.call_context`), `workers.megatron.launch` around each spawned rank's work.
  - Any `device=` naming CUDA (pipeline schedules, optimizer found_inf, grad scaler, clip_grads, grad
    buffers) and CUDA targets of `Tensor.to` become CPU; `Tensor.cuda()` and `Tensor.pin_memory()`
    return the tensor; `pin_memory=True` is dropped.
  - `Tensor.type()` reports `torch.cuda.*` names (asserts in clip_grads and DistributedOptimizer), and
    `Tensor.type('torch.cuda.X')` means `torch.X`.
- Without Transformer Engine (CPU, or a GPU without TE), also by `apply_cpu_compat()`: `moe_utils.
  te_general_gemm` is bound to None, and the torch norms take sequence parallelism (MoE at TP > 1).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

MCORE_VERSION = "0.16.1"  # the megatron-core whose internals the patches below replace

_CPU = torch.device("cpu")
_applied = False
_apply_lock = threading.Lock()


def cuda_absent() -> bool:
    """True when the compatibility layer is needed (no usable CUDA device)."""
    return not torch.cuda.is_available()


def _is_cuda_device(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return False


def _cuda_type_name(name: str) -> str:
    """'torch.FloatTensor' -> 'torch.cuda.FloatTensor' (what megatron's asserts expect)."""
    if name.startswith("torch.") and not name.startswith("torch.cuda."):
        return "torch.cuda." + name[len("torch.") :]
    return name


class CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA device requests to CPU and reports CUDA tensor type names (see module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs) if kwargs else {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type:
            if len(args) == 1 and not kwargs:
                return _cuda_type_name(func(*args))
            if len(args) > 1 and isinstance(args[1], str):
                args = (args[0], args[1].replace("torch.cuda.", "torch."), *args[2:])
            if isinstance(kwargs.get("dtype"), str):
                kwargs["dtype"] = kwargs["dtype"].replace("torch.cuda.", "torch.")
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and any(_is_cuda_device(a) for a in args[1:]):
            args = tuple(_CPU if i > 0 and _is_cuda_device(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _cpu_set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _tracker_add(self, name: str, seed: int) -> None:
    """CudaRNGStatesTracker.add on the CPU generator."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    orig = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(orig)


@contextlib.contextmanager
def _tracker_fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
    """CudaRNGStatesTracker.fork on the CPU generator, without the 'CPU RNG changed' warning."""
    if name not in self.states_:
        raise Exception(f"rng state {name} is not added")
    orig_state = torch.get_rng_state()
    orig_name = self._current_state_name
    if orig_name != "default-rng":
        self.states_[orig_name] = orig_state
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        if self._current_state_name != name:
            raise Exception(f"current rng state {self._current_state_name} is not {name}")
        self.states_[name] = torch.get_rng_state()
        if orig_name != "default-rng":
            orig_state = self.states_[orig_name]
        torch.set_rng_state(orig_state)
        self._current_state_name = orig_name


def check_mcore_version(installed: str | None = None) -> None:
    """Raise RuntimeError unless megatron-core is the version these patches were written for."""
    installed = installed or importlib.metadata.version("megatron-core")
    if installed != MCORE_VERSION:
        raise RuntimeError(f"workers/megatron/cpu_compat.py patches megatron-core {MCORE_VERSION} internals, "
                           f"but megatron-core {installed} is installed")


def _define_te_general_gemm() -> None:
    """megatron-core 0.16.1's MoE router (`moe_utils.router_gating_linear`) tests `te_general_gemm is not
    None`, but the name is only bound when Transformer Engine imports; without TE (CPU, or GPU without TE)
    every MoE forward raises NameError. Bind it to None there, so the router takes its torch path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


def _torch_norm_sequence_parallel() -> None:
    """Without Transformer Engine the layer spec's norms are megatron's `WrappedTorchNorm` (torch RMSNorm),
    which asserts `not config.sequence_parallel`: the torch norm does not tag its weights for the TP
    all-reduce their gradients need when each TP rank normalised only its slice of the sequence. MoE layers
    train at TP > 1 only with sequence parallelism, so build the norm as usual and tag its parameters
    `sequence_parallel` (what TE's norms do), so that `finalize_model_grads` all-reduces their gradients."""
    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__
    if getattr(original, "_rlhf_sequence_parallel", False):
        return

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
            normalization="LayerNorm"):
        if not config.sequence_parallel:
            return original(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        config.sequence_parallel = False
        try:
            norm = original(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization)
        finally:
            config.sequence_parallel = True
        for p in norm.parameters():
            p.sequence_parallel = True
        return norm

    new._rlhf_sequence_parallel = True  # type: ignore[attr-defined]
    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)  # type: ignore[method-assign,assignment]
def _mla_without_te() -> None:
    """megatron-core 0.16.1's `multi_latent_attention` sets HAVE_TE when its TE imports succeed, and without
    Transformer Engine they do: megatron's TE extension then binds MagicMocks. Its `isinstance(..., TELinear)`
    check on a MagicMock raises TypeError while building MLA; without TE installed, HAVE_TE is set False."""
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        from megatron.core.transformer import multi_latent_attention

        multi_latent_attention.HAVE_TE = False


def _fix_expert_bias_padding() -> None:
    """megatron-core 0.16.1's `TopKRouter._apply_expert_bias` (the token counts of the expert-bias update)
    masks the routing map [tokens, experts] with the padding mask [tokens] unbroadcast, so any MoE forward
    with an expert bias and a padding mask raises (on any device). Replaced by the same count with the mask
    as a column."""
    from megatron.core.transformer.moe.router import TopKRouter

    if getattr(TopKRouter._apply_expert_bias, "_rlhf_fixed", False):
        return

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    _apply_expert_bias._rlhf_fixed = True  # type: ignore[attr-defined]
    TopKRouter._apply_expert_bias = _apply_expert_bias  # type: ignore[method-assign]


def _in_process_save_results() -> None:
    """megatron-core 0.16.1's `filesystem_async._get_write_results_queue` starts a `spawn` multiprocessing
    Manager the first time a process saves a checkpoint, so that an asynchronous save's writer process can pass
    its results back. Every save here is synchronous (`dist_checkpointing.save`: the write plan runs in the
    saving process, which then reads the results itself), so the queue never leaves the process; the spawned
    manager cost a fresh interpreter: 3.5 of the 3.9 s of a tiny model's first save on 2 cores, in every rank.
    An in-process queue takes its place (on any device). An asynchronous save would need the original."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def apply_cpu_compat() -> bool:
    """Apply the process-wide patches when CUDA is absent, once; True when they are active."""
    global _applied
    _define_te_general_gemm()
    _torch_norm_sequence_parallel()
    _mla_without_te()
    _fix_expert_bias_padding()
    _in_process_save_results()
    if not cuda_absent():
        return False
    with _apply_lock:
        if not _applied:
            check_mcore_version()
            from megatron.core.tensor_parallel import random as mrandom

            torch.cuda.current_device = lambda: _CPU  # type: ignore[assignment]
            torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
            torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)  # type: ignore[assignment]
            mrandom._get_cuda_rng_state = _cpu_get_rng_state
            mrandom._set_cuda_rng_state = _cpu_set_rng_state
            mrandom.CudaRNGStatesTracker.add = _tracker_add
            mrandom.CudaRNGStatesTracker.fork = _tracker_fork
            _applied = True
    return True


@contextlib.contextmanager
def cpu_device_mode() -> Iterator[None]:
    """`CpuDeviceMode` active in this thread inside the block (no-op with CUDA or when already active)."""
    if not cuda_absent() or any(isinstance(m, CpuDeviceMode) for m in _get_current_function_mode_stack()):
        yield
        return
    with CpuDeviceMode():
        yield
