"""GPU specs for the roofline: dense bf16 peak, memory, NVLink and inter-node bandwidth per GPU.

Sources (vendor datasheets): NVIDIA H100 SXM and H200 SXM datasheets (989 TFLOP/s dense bf16, NVLink 4
900 GB/s total = 450 GB/s each way), A100 80GB SXM datasheet (312 TFLOP/s, NVLink 3 600 GB/s total);
H800: the DeepSeek-V3 technical report, section 3.1 (NVLink 160 GB/s, InfiniBand 50 GB/s per GPU).
Inter-node: one 400 Gb/s NIC per GPU (50 GB/s) on H100/H200/H800 clusters, 200 Gb/s (25 GB/s) on A100.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.errors import UserError

GIB = 1024**3


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float  # dense peak, FLOP/s
    memory: float  # bytes
    nvlink_bw: float  # bytes/s one way, per GPU, within a node
    net_bw: float  # bytes/s one way, per GPU, across nodes


GPUS: dict[str, GPU] = {
    "H100": GPU("H100", 989e12, 80 * GIB, 450e9, 50e9),
    "H200": GPU("H200", 989e12, 141e9, 450e9, 50e9),
    "H800": GPU("H800", 989e12, 80 * GIB, 160e9, 50e9),
    "A100": GPU("A100", 312e12, 80 * GIB, 300e9, 25e9),
}


def get_gpu(name: str) -> GPU:
    key = {k.lower(): k for k in GPUS}.get(name.lower())
    if key is None:
        raise UserError(f"--gpu: unknown GPU {name!r}; choose one of {', '.join(GPUS)}")
    return GPUS[key]


def parse_bytes(text: str) -> float:
    """'80GiB', '141GB', '80' (GiB) -> bytes."""
    t = text.strip()
    units = {"gib": GIB, "gb": 1e9, "mib": 1024**2, "mb": 1e6, "tib": 1024**4}
    for unit, mult in units.items():
        if t.lower().endswith(unit):
            t, scale = t[: -len(unit)], mult
            break
    else:
        scale = GIB
    try:
        value = float(t)
    except ValueError:
        raise UserError(f"--gpu-mem: expected a size like 80GiB or 141GB, got {text!r}") from None
    if value <= 0:
        raise UserError(f"--gpu-mem: must be > 0, got {text!r}")
    return value * scale
