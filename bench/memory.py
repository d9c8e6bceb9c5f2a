"""Activation memory of one training forward, measured against `rlhf plan`'s estimate.

Measured: the bytes autograd keeps for backward during one forward with labels of the engine's megatron model
(unique tensor storages saved by `torch.autograd.graph.saved_tensors_hooks`, parameters excluded) on one CPU
rank: exactly the activations the Korthikanti accounting counts, without allocator noise. Estimated:
`rlhf.plan.memory.stage_activation_bytes` with no flash attention (megatron's local-spec attention keeps the
softmax output), no dropout and the model's dtype: once with the fused-kernel terms the planner uses for
GPUs, once with the unfused CPU path's terms (torch RMSNorm keeps two fp32 copies of its input, a 16-bit
model's softmax runs in fp32 and keeps that output too, SwiGLU keeps SiLU's output).

Then the memory levers (`recompute`, `sequence_parallel`, `cp`): the same measurement in fp32 per rank, at TP1
with recompute none / selective / full, at TP2 without and with sequence parallelism and at CP2 (each rank runs
its half of the columns; the estimate counts the gathered K / V and the scores over the whole sequence that
the engine's CP attention keeps), against the estimate. The engine also gathers the logits into whole rows for
the loss, which this forward with labels (each rank's own columns) does not include.
With full recompute the peak comes in the backward: the kept layer inputs plus what one recomputed layer
saves again (the backward's re-saved bytes over the layer count).

Then the trainer's memory with and without LoRA (issue 21) on the ~100M preset (`--lora-preset base-qwen2`, fp32,
Adam, one step, each in a fresh process): parameters, trainable parameters, gradient buffer and optimizer state
(Adam's two moments; fp32 needs no master copy) as the engine holds them, and the process's peak RSS.

    python bench/memory.py [--preset small-qwen2] [--seq 512] [--mbs 2] [--lora-preset base-qwen2] [--lora-rank 16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import machine_line, ratio_line, table
from _memory_fns import saved_activation_bytes, trainer_memory


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small-qwen2")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--lora-preset", default="base-qwen2", help="the model of the with / without LoRA rows")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--skip-activations", action="store_true", help="only the LoRA rows")
    ap.add_argument("--skip-lora", action="store_true", help="no LoRA rows")
    args = ap.parse_args()

    from rlhf.tiny_models import create_tiny_model
    from workers.megatron.launch import run_distributed

    print(machine_line())
    if not args.skip_activations:
        activations(args)
        lever_rows(args)
    if not args.skip_lora:
        lora_rows(args, create_tiny_model, run_distributed)


def lora_rows(args: argparse.Namespace, create_tiny_model, run_distributed) -> None:
    """Trainer memory of one step with and without LoRA (all four linear targets) on `--lora-preset`."""
    out = Path("runs/bench/memory") / args.lora_preset
    if not (out / "config.json").is_file():
        create_tiny_model(args.lora_preset, out)
    lora = {"rank": args.lora_rank, "alpha": 2.0 * args.lora_rank}
    res = {name: run_distributed(trainer_memory, 1, args=(str(out), cfg))[0]
           for name, cfg in (("full", None), (f"lora r={args.lora_rank}", lora))}
    mib = 2**20
    rows = [[name, f"{r['params'] / 1e6:.1f}M", f"{r['trainable'] / 1e6:.3f}M", f"{r['param_bytes'] / mib:.0f}",
             f"{r['grad_bytes'] / mib:.1f}", f"{r['optimizer_bytes'] / mib:.1f}", f"{r['peak_rss'] / mib:.0f}"]
            for name, r in res.items()]
    print(f"{args.lora_preset}, fp32, Adam, one step of micro-batch 2 x 128 tokens, TP1, one process each")
    print(table(["trainer", "parameters", "trainable", "param MiB", "grad buffer MiB", "optimizer state MiB",
                 "peak RSS MiB"], rows))
    full, low = res["full"], res[f"lora r={args.lora_rank}"]
    print(ratio_line("lora_optimizer_state_vs_full", low["optimizer_bytes"] / full["optimizer_bytes"]))
    print(ratio_line("lora_trainable_vs_full", low["trainable"] / full["trainable"]))
    print(ratio_line("lora_peak_rss_vs_full", low["peak_rss"] / full["peak_rss"]))


def activations(args: argparse.Namespace) -> None:
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
    print(f"{args.preset}, seq {args.seq}, micro-batch {args.mbs}, TP1 PP1, one forward with labels")
    print(table(["dtype", "measured MiB", "fused-path estimate MiB", "ratio", "CPU-path estimate MiB", "ratio"],
                rows))
    for r in rows:
        print(ratio_line(f"activation_estimate_vs_measured_{r[0]}", float(r[5])))


def lever_rows(args: argparse.Namespace) -> None:
    """Saved activations per rank with each memory lever (fp32, CPU-path terms) against the plan's estimate."""
    from rlhf.plan.layout import Layout
    from rlhf.plan.memory import ActOptions, stage_activation_bytes
    from rlhf.plan.model import load_model
    from workers.megatron.launch import run_distributed

    out = Path("runs/bench/memory") / args.preset  # created by activations()
    m = load_model(args.preset)
    opts = ActOptions(elem=4, flash_attention=False, norm_bytes=8, fused_swiglu=False, cp_gathered_kv=True)
    measured: dict[str, float] = {}
    rows = []
    for name, tp, cp, recompute, sp in (("none", 1, 1, "none", False), ("selective", 1, 1, "selective", False),
                                        ("full", 1, 1, "full", False), ("tp2", 2, 1, "none", False),
                                        ("tp2 + sequence parallel", 2, 1, "none", True),
                                        ("cp2", 1, 2, "none", False)):
        ranks = run_distributed(saved_activation_bytes, tp * cp, args=(str(out), "float32", args.seq, args.mbs,
                                                                       recompute, sp), tp=tp, cp=cp)
        # full recompute's peak: the kept inputs plus one recomputed chunk's activations during its backward
        chunks = m.layers  # recompute_num_layers 1
        got = max(r["saved_bytes"] + r["recomputed_bytes"] / chunks for r in ranks)
        est = stage_activation_bytes(m, Layout(tp=tp, cp=cp, mbs=args.mbs, recompute=recompute, sp=sp), args.seq,
                                     1, 0, opts)
        measured[name] = got
        rows.append([name, f"{got / 2**20:.1f}", f"{est / 2**20:.1f}", f"{est / got:.3f}"])
    print(f"{args.preset}, fp32, seq {args.seq}, micro-batch {args.mbs}: saved activations of the fullest rank")
    print(table(["levers", "measured MiB", "CPU-path estimate MiB", "ratio"], rows))
    print(ratio_line("activation_selective_recompute_vs_none", measured["selective"] / measured["none"]))
    print(ratio_line("activation_full_recompute_vs_none", measured["full"] / measured["none"]))
    print(ratio_line("activation_sequence_parallel_vs_tp2", measured["tp2 + sequence parallel"] / measured["tp2"]))
    print(ratio_line("activation_cp2_vs_none", measured["cp2"] / measured["none"]))


if __name__ == "__main__":
    main()
