"""`rlhf init-model`: write a tiny HF model with a local tokenizer."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    from rlhf.tiny_models import PRESETS

    p = sub.add_parser("init-model", help="create a tiny HF model folder (no hub access)")
    p.add_argument("--preset", required=True, help=f"one of: {', '.join(PRESETS)}")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite a non-empty output folder")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rlhf.paths import staged_output_dir
    from rlhf.tiny_models import create_tiny_model, get_preset
    from workers.file_problems import file_errors

    get_preset(args.preset)  # fail on a bad preset before touching the output folder
    # written under a temporary name, renamed when complete: a full disk leaves no model-looking folder
    with staged_output_dir(args.out, force=args.force) as tmp, file_errors(args.out, "write"):
        create_tiny_model(args.preset, tmp, seed=args.seed)
    print(f"wrote {args.preset} to {args.out}")
    return 0
