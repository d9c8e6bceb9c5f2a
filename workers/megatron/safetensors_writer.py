"""Write a safetensors file tensor by tensor, without holding all tensors in memory.

The header (names, dtypes, shapes, offsets) is written first from a declared list of tensors; each
tensor's bytes are then written at its offset as it arrives, in any order.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def safetensors_dtype(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype ('F32', 'BF16', ...)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype} cannot be written to safetensors here")
    return _DTYPES[dtype]


class StreamingSafetensorsWriter:
    """Declare (name, shape, dtype) for every tensor up front, then `write` each one exactly once."""

    def __init__(
        self,
        path: str | Path,
        specs: Sequence[tuple[str, Sequence[int], torch.dtype]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = Path(path)
        self._specs = {name: (tuple(shape), dtype) for name, shape, dtype in specs}
        if len(self._specs) != len(specs):
            raise ValueError("duplicate tensor names in the declared specs")
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        self._offsets: dict[str, int] = {}
        offset = 0
        for name, shape, dtype in specs:
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": safetensors_dtype(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._offsets[name] = offset
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._data_start = 8 + len(raw)
        self._written: set[str] = set()
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(len(raw).to_bytes(8, "little"))
        self._file.write(raw)
        self._file.truncate(self._data_start + offset)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write `tensor`'s bytes at its declared place; its shape and dtype must match the declaration."""
        if name not in self._specs:
            raise ValueError(f"tensor {name} was not declared for {self.path.name}")
        if name in self._written:
            raise ValueError(f"tensor {name} written twice to {self.path.name}")
        shape, dtype = self._specs[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"tensor {name}: got {list(tensor.shape)} {tensor.dtype}, declared {list(shape)} {dtype}")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self._file.seek(self._data_start + self._offsets[name])
        self._file.write(memoryview(data))
        self._written.add(name)

    def close(self) -> None:
        """Close the file; raises ValueError naming a declared tensor that was never written."""
        self._file.close()
        missing = [n for n in self._specs if n not in self._written]
        if missing:
            raise ValueError(f"tensor {missing[0]} was declared but never written to {self.path.name}")

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(self, exc_type, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()
