"""`build`: a worker-side config dataclass from a schema section, a dict or None, with no renaming.

The worker-side config classes (`PPOLossConfig`, `OptimSettings`, `EngineConfig`, `SamplingConfig`,
`SyncConfig`, ...) declare the settings; the run's schema (`rlhf.config.schema`) uses them as its
sections' bases, so a schema section holds every field under the same name and `build` only picks.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def build(cls: type[T], source: Any = None, **overrides: Any) -> T:
    """A `cls` from `source`: None (the defaults), a `cls`, a dict of `cls` fields (an unknown key is an
    error), or any dataclass instance (its fields that `cls` has, e.g. a schema section); `overrides`
    (derived values, e.g. a path or a timeout) win."""
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    if source is None:
        values: dict[str, Any] = {}
    elif isinstance(source, dict):
        unknown = sorted(set(source) - set(names))
        if unknown:
            raise ValueError(f"unknown {cls.__name__} keys {unknown}; known: {sorted(names)}")
        values = dict(source)
    elif is_dataclass(source):
        if type(source) is cls and not overrides:
            return source
        values = {n: getattr(source, n) for n in names if hasattr(source, n)}
    else:
        raise TypeError(f"{cls.__name__}: expected None, a dict or a dataclass, got {type(source).__name__}")
    return cls(**{**values, **overrides})
