"""Parameter dtypes by name: the one table of the names configs, checkpoints and the converter use."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The parameter dtypes a config, a checkpoint or the converter may name (torch's names). Plain strings, so
# the config checks name them without importing torch.
DTYPE_NAMES = ("float32", "bfloat16", "float16")
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a name ('bfloat16' or 'bf16', ...); a torch dtype passes through."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    name = _ALIASES.get(dtype, dtype)
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join([*DTYPE_NAMES, *_ALIASES])}")
    return getattr(torch, name)
