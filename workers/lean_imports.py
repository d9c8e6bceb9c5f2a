"""Keep out of library imports what a process never uses, or what an earlier process already computed; each
process that imports `workers` or `rlhf` gets these hooks, and every Megatron worker and rollout engine imports
`workers` first.

- transformers (5.x) imports `sklearn.metrics` from `transformers.generation.candidate_generator` whenever
  scikit-learn is installed (lm-eval, in the eval extra, installs it), for one feature: the confidence
  threshold of HF's assisted decoding, which nothing here uses (generation runs on vLLM). Any
  `AutoConfig.from_pretrained` reaches that module, so every Megatron worker, rollout engine and CLI process
  paid for scikit-learn and SciPy: about 2.5 s of CPU each on 2 cores. That one module sees scikit-learn as
  absent while it is imported; the package stays importable for whoever imports it directly (lm-eval).
- megatron-core's `megatron.core.jit.jit_fuser` is `torch.compile`, applied as a decorator while megatron-core
  imports its fusions, which imports Inductor (about 3 s of CPU per process, TorchDynamo included when
  transformers has not imported it already). Without CUDA
  the fuser is made the no-op megatron-core itself offers (`disable_jit_fuser`): the decorated functions run
  eagerly, as they would have before a compile, and nothing on CPU compiles them at first call. With CUDA
  nothing changes.
- megatron-core's timers and dynamic inference context import wandb if installed (about 1 s) for logging
  features of its own training loop and inference engine, which nothing here runs. While those modules are
  imported, wandb reads as absent; the package stays importable (rlhf's metrics logger imports it when
  `trainer.logger` asks for it).
- transformers maps import names to distributions with `importlib.metadata.packages_distributions()` while
  `transformers.utils.import_utils` is imported: 1.3 s of CPU per process, reading every RECORD file. While that
  module is imported the call is answered from a file kept between processes (workers/dist_cache.py), named
  after the installed set, so an install or removal is never answered from an old file.
- transformers' `auto_docstring` decorator writes the documentation of each config and model class as the class
  is defined, and for that imports the auto-model registry, the generation and masking utilities: about 3 s of
  CPU in a process that only reads a config.json (every Megatron worker). It is replaced by a decorator that
  returns the class or function unchanged: the same objects, without generated docstrings (only `help()`
  text differs).
- vLLM's audio module imports `scipy.signal` (about 1.3 s) for one of its audio resamplers; nothing here takes
  audio, and vLLM itself falls back to a placeholder that fails only when that resampler is called.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

_SKLEARN_USER = "transformers.generation.candidate_generator"
_JIT = "megatron.core.jit"
_AUDIO = "vllm.multimodal.audio"
_DISTRIBUTIONS_USER = "transformers.utils.import_utils"
_DOCSTRINGS = "transformers.utils"
_WANDB_USERS = ("megatron.core.inference.contexts.dynamic_context", "megatron.core.timers")


def _without_sklearn(run: Callable[[ModuleType], None], module: ModuleType) -> None:
    import transformers.utils as hf_utils

    found = hf_utils.is_sklearn_available
    hf_utils.is_sklearn_available = lambda: False  # read by the module's `from ..utils import`
    try:
        run(module)
    finally:
        hf_utils.is_sklearn_available = found


def _cached_distributions(run: Callable[[ModuleType], None], module: ModuleType) -> None:
    import importlib.metadata

    from workers.dist_cache import packages_distributions

    computed = importlib.metadata.packages_distributions
    importlib.metadata.packages_distributions = lambda: packages_distributions(compute=computed)
    try:
        run(module)
    finally:
        importlib.metadata.packages_distributions = computed


def _undocumented(obj: Any = None, **_: Any) -> Any:
    """`auto_docstring` without the docs: `@_undocumented` and `@_undocumented(custom_intro=...)` both return
    the object they decorate."""
    return obj if obj is not None else (lambda target: target)


def _no_generated_docstrings(run: Callable[[ModuleType], None], module: ModuleType) -> None:
    run(module)
    module.auto_docstring = _undocumented  # type: ignore[attr-defined]  # read by `from ...utils import`


def _eager_fuser_without_cuda(run: Callable[[ModuleType], None], module: ModuleType) -> None:
    run(module)
    import torch

    if not torch.cuda.is_available():
        module.disable_jit_fuser()


def _without(name: str) -> Callable[[Callable[[ModuleType], None], ModuleType], None]:
    """A hook that runs a module with `import <name>` raising ImportError (unless this process has it already)."""
    def hook(run: Callable[[ModuleType], None], module: ModuleType) -> None:
        if name in sys.modules:  # already imported by this process: nothing to save
            run(module)
            return
        sys.modules[name] = None  # type: ignore[assignment]  # `import <name>` raises ImportError
        try:
            run(module)
        finally:
            del sys.modules[name]

    return hook


HOOKS: dict[str, Callable[[Callable[[ModuleType], None], ModuleType], None]] = {
    _SKLEARN_USER: _without_sklearn,
    _JIT: _eager_fuser_without_cuda,
    **{name: _without("wandb") for name in _WANDB_USERS},
    _AUDIO: _without("scipy.signal"),
    _DISTRIBUTIONS_USER: _cached_distributions,
    _DOCSTRINGS: _no_generated_docstrings,
}


class _LeanImports(importlib.abc.MetaPathFinder):
    """Finds each module of HOOKS as the path finder does, and runs it through its hook."""

    def find_spec(self, name: str, path: Any = None, target: ModuleType | None = None) -> Any:
        hook = HOOKS.get(name)
        if hook is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module
        spec.loader.exec_module = lambda module: hook(run, module)  # type: ignore[method-assign]
        return spec


def install_lean_imports() -> None:
    """Install the finder once in this process (it imports nothing)."""
    if not any(isinstance(f, _LeanImports) for f in sys.meta_path):
        sys.meta_path.insert(0, _LeanImports())
