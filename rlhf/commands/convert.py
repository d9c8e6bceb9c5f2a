"""`rlhf convert`: HF <-> megatron-core checkpoint conversion (Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V2, DeepSeek-V3)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="convert checkpoints between HF and megatron-core (dist_checkpointing)")
    conv = p.add_subparsers(dest="direction", metavar="DIRECTION")
    conv.required = True

    h2m = conv.add_parser("hf-to-mcore", help="HF folder -> megatron-core dist_checkpointing folder")
    h2m.add_argument("--hf", required=True, help="HF model folder (config.json, *.safetensors, tokenizer)")
    h2m.add_argument("--out", required=True, help="output folder")
    h2m.add_argument("--tp", type=int, default=1, help="tensor parallel size of the converting ranks")
    h2m.add_argument("--pp", type=int, default=1, help="pipeline parallel size of the converting ranks")
    h2m.add_argument("--ep", type=int, default=1, help="expert parallel size (MoE models; ranks = tp*pp*ep)")
    h2m.add_argument("--dtype", default="auto", help="auto (the weights' dtype), float32, bfloat16, float16")
    h2m.add_argument("--force", action="store_true", help="overwrite a non-empty output folder")
    h2m.set_defaults(func=run_hf_to_mcore)

    m2h = conv.add_parser("mcore-to-hf", help="megatron-core folder (from hf-to-mcore or training) -> HF folder")
    m2h.add_argument("--mcore", required=True, help="converted megatron checkpoint folder, or a training "
                     "checkpoint's policy: <run>/checkpoints/<step>/policy (read with <run>/config.yaml)")
    m2h.add_argument("--out", required=True, help="output HF folder")
    m2h.add_argument("--tp", type=int, default=1, help="tensor parallel size to load the checkpoint at")
    m2h.add_argument("--pp", type=int, default=1, help="pipeline parallel size to load at (one file per stage)")
    m2h.add_argument("--ep", type=int, default=1, help="expert parallel size to load at (MoE models)")
    m2h.add_argument("--force", action="store_true", help="overwrite a non-empty output folder")
    m2h.add_argument("--trust-checkpoint", action="store_true",
                     help="load a checkpoint without a matching rlhf manifest (its pickles can run code)")
    m2h.set_defaults(func=run_mcore_to_hf)


def run_hf_to_mcore(args: argparse.Namespace) -> int:
    import time

    from rlhf.conversion.convert import hf_to_mcore

    t0 = time.monotonic()
    out = hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, force=args.force, dtype=args.dtype,
                      ep=args.ep)
    print(f"wrote megatron checkpoint (tp={args.tp}, pp={args.pp}, ep={args.ep}) to {out} in {time.monotonic() - t0:.1f}s")
    return 0


def run_mcore_to_hf(args: argparse.Namespace) -> int:
    import time

    from rlhf.conversion.convert import mcore_to_hf

    t0 = time.monotonic()
    out = mcore_to_hf(args.mcore, args.out, force=args.force, tp=args.tp, pp=args.pp, ep=args.ep,
                      trust=args.trust_checkpoint)
    print(f"wrote HF model to {out} in {time.monotonic() - t0:.1f}s")
    return 0
