"""Run megatron-core on CPU over gloo: the patches for its CUDA assumptions, applied only without CUDA.

Every patch is a no-op when `torch.cuda.is_available()`; GPU runs are untouched. Why each one exists
(measured on megatron-core 0.16.1, see shared/notes/stack.md):

Process-wide, by `apply_cpu_compat()` (idempotent):
- `torch.cuda.current_device()` is called at ~100 sites (GlobalMemoryBuffer, TP mappings, RoPE, p2p)
  and used as a `device=`; it returns the CPU device.
- `torch.cuda.synchronize()` raises without CUDA; it becomes a no-op.
- `torch.cuda.manual_seed()` seeds the "default" CUDA generator in `model_parallel_cuda_manual_seed`;
  on CPU the CPU generator plays that role.
- `tensor_parallel.random._get_cuda_rng_state` / `_set_cuda_rng_state` read and write the CUDA
  generator; they use the CPU generator.
- `CudaRNGStatesTracker.add` seeds through the CUDA generator, and `.fork` (entered by attention even
  with dropout 0 and by weight init) warns whenever the CPU generator moves inside it, which on CPU is
  always; both are replaced by CPU-generator versions with the same semantics.

Per thread, by the `CpuDeviceMode` TorchFunctionMode (`cpu_device_mode()`, `ensure_cpu_device_mode()`,
`@on_cpu_device`):
- Hard-coded `device='cuda'` in the pipeline schedules, optimizer (found_inf), grad scaler, clip_grads
  and param_and_grad_buffer: any `device=` that names CUDA is rewritten to CPU, as are CUDA targets
  of `Tensor.to(...)`.
- `Tensor.cuda()` returns the tensor itself; `pin_memory=True` is dropped and `Tensor.pin_memory()`
  returns the tensor.
- Asserts such as `param.grad.type() == 'torch.cuda.FloatTensor'` (clip_grads, DistributedOptimizer):
  `Tensor.type()` reports `torch.cuda.*` names, and `Tensor.type('torch.cuda.X')` means `torch.X`.

TorchFunctionModes are thread-local. A process enters the mode in its main thread; code that may run
in other threads (Ray actor methods, thread pools) uses `@on_cpu_device` on its entry points or calls
`ensure_cpu_device_mode()` first thing in the thread. Entering is idempotent per thread.

Also `causal_mask(seq_len)`: megatron's `get_default_causal_mask` builds a CUDA tensor when no mask is
passed, so CPU callers pass this explicit boolean mask.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode

F = TypeVar("F", bound=Callable[..., Any])

_CPU = torch.device("cpu")
_applied = False
_apply_lock = threading.Lock()
_tls = threading.local()


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


def apply_cpu_compat() -> bool:
    """Apply the process-wide patches when CUDA is absent; idempotent. Returns True if patches are active.

    Also enters the `CpuDeviceMode` in the calling thread (see `ensure_cpu_device_mode`).
    """
    global _applied
    if not cuda_absent():
        return False
    with _apply_lock:
        if not _applied:
            from megatron.core.tensor_parallel import random as mrandom

            torch.cuda.current_device = lambda: _CPU  # type: ignore[assignment]
            torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
            torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)  # type: ignore[assignment]
            mrandom._get_cuda_rng_state = _cpu_get_rng_state
            mrandom._set_cuda_rng_state = _cpu_set_rng_state
            mrandom.CudaRNGStatesTracker.add = _tracker_add
            mrandom.CudaRNGStatesTracker.fork = _tracker_fork
            _applied = True
    ensure_cpu_device_mode()
    return True


def ensure_cpu_device_mode() -> None:
    """Enter `CpuDeviceMode` in the calling thread for the rest of its life (no-op with CUDA or if active).

    The mode stays on the thread's TorchFunctionMode stack; entering it again in the same thread does
    nothing. Call it at the start of any thread that runs megatron code.
    """
    if not cuda_absent() or _mode_active():
        return
    mode = CpuDeviceMode()
    mode.__enter__()
    _tls.persistent = mode


def _mode_active() -> bool:
    from torch.overrides import _get_current_function_mode_stack

    return any(isinstance(m, CpuDeviceMode) for m in _get_current_function_mode_stack())


@contextlib.contextmanager
def cpu_device_mode() -> Iterator[None]:
    """Context manager: `CpuDeviceMode` active in this thread inside the block (no-op with CUDA or if active)."""
    if not cuda_absent() or _mode_active():
        yield
        return
    with CpuDeviceMode():
        yield


def on_cpu_device(fn: F) -> F:
    """Decorator for entry points that may run in any thread (e.g. Ray actor methods): runs `fn` with
    the process patches applied and `CpuDeviceMode` active in the current thread (no-op with CUDA)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not cuda_absent():
            return fn(*args, **kwargs)
        apply_cpu_compat()
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def causal_mask(seq_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean causal attention mask [1, 1, S, S] for megatron-core, True = masked (future positions)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]
