"""Activation memory of one training forward, measured against `rlhf plan`'s estimate.

Measured: the bytes autograd keeps for backward during one forward with labels of the engine's megatron model
(unique tensor storages saved by `torch.autograd.graph.saved_tensors_hooks`, parameters excluded) on one CPU
rank: exactly the activations the Korthikanti accounting counts, without allocator noise. Estimated:
`rlhf.plan.memory.stage_activation_bytes` with no flash attention (megatron's local-spec attention keeps the
softmax output), no dropout and the model's dtype: once with the fused-kernel terms the planner uses for
GPUs, once with the unfused CPU path's terms (torch RMSNorm keeps two fp32 copies of its input, a 16-bit
model's softmax runs in fp32 and keeps that output too, SwiGLU keeps SiLU's output).

    python bench/memory.py [--preset small-qwen2] [--seq 512] [--mbs 2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import machine_line, ratio_line, table
from _memory_fns import saved_activation_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small-qwen2")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--mbs", type=int, default=2)
    args = ap.parse_args()

    from rlhf.plan.layout import Layout
    from rlhf.plan.memory import ActOptions, stage_activation_bytes
    from rlhf.plan.model import load_model
    from rlhf.tiny_models import create_tiny_model
    from workers.megatron.launch import run_distributed

    out = Path("runs/bench/memory") / args.preset
    if not (out / "config.json").is_file():
        create_tiny_model(args.preset, out)
    m = load_model(args.preset)
    rows = []
    for dtype, elem in (("float32", 4), ("bfloat16", 2)):
        measured = run_distributed(saved_activation_bytes, 1, args=(str(out), dtype, args.seq, args.mbs))[0]
        gpu_path = stage_activation_bytes(m, Layout(mbs=args.mbs), args.seq, 1, 0,
                                          ActOptions(elem=elem, flash_attention=False))
        cpu_path = stage_activation_bytes(m, Layout(mbs=args.mbs), args.seq, 1, 0, ActOptions(
            elem=elem, flash_attention=False, norm_bytes=8, softmax_extra=4 if elem < 4 else 0,
            fused_swiglu=False))
        got = measured["saved_bytes"]
        rows.append([dtype, f"{got / 2**20:.1f}", f"{gpu_path / 2**20:.1f}", f"{gpu_path / got:.3f}",
                     f"{cpu_path / 2**20:.1f}", f"{cpu_path / got:.3f}"])
    print(machine_line())
    print(f"{args.preset}, seq {args.seq}, micro-batch {args.mbs}, TP1 PP1, one forward with labels")
    print(table(["dtype", "measured MiB", "fused-path estimate MiB", "ratio", "CPU-path estimate MiB", "ratio"],
                rows))
    for r in rows:
        print(ratio_line(f"activation_estimate_vs_measured_{r[0]}", float(r[5])))


if __name__ == "__main__":
    main()
