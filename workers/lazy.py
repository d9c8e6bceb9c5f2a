"""Package exports imported on first use (PEP 562), so that importing one light module of a package (the
config classes the schema builds on) does not import Ray, torch.distributed or vLLM with its siblings."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_getattr(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package` that imports `exports[name]` (a module path) when `name` is used."""

    def module_getattr(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return module_getattr
