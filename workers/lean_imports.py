"""Keep scikit-learn out of every process that imports transformers' generation utilities.

transformers (5.x) imports `sklearn.metrics` from `transformers.generation.candidate_generator` whenever
scikit-learn is installed (lm-eval, in the eval extra, installs it), for one feature: the confidence threshold
of HF's assisted decoding, which nothing here uses (generation runs on vLLM). Any `AutoConfig.from_pretrained`
reaches that module (the config classes' docstring decorator imports the auto model classes), so every
Megatron worker, rollout engine and CLI process paid for scikit-learn and SciPy: about 2.5 s of CPU each on
2 cores. The finder below lets that one module see scikit-learn as absent while it is imported; the package
itself stays importable for whoever imports it directly (lm-eval).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

_MODULE = "transformers.generation.candidate_generator"


class _WithoutSklearn(importlib.abc.MetaPathFinder):
    """Finds `_MODULE` as the path finder does, and runs it with `is_sklearn_available` answering False."""

    def find_spec(self, name: str, path: Any = None, target: ModuleType | None = None) -> Any:
        if name != _MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            import transformers.utils as hf_utils

            found = hf_utils.is_sklearn_available
            hf_utils.is_sklearn_available = lambda: False  # read by the module's `from ..utils import` below
            try:
                run(module)
            finally:
                hf_utils.is_sklearn_available = found

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def skip_sklearn_in_transformers() -> None:
    """Install the finder once in this process (it imports nothing)."""
    if not any(isinstance(f, _WithoutSklearn) for f in sys.meta_path):
        sys.meta_path.insert(0, _WithoutSklearn())
