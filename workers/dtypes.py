"""Parameter dtypes by name: the one table of the names configs, checkpoints and the converter use."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a name ('bfloat16' or 'bf16', ...); a torch dtype passes through."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = _ALIASES.get(dtype, dtype)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join([*DTYPES, *_ALIASES])}")
    return DTYPES[name]

