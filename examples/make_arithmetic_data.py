"""Write the tiny arithmetic task's data files (RL prompts, SFT conversations, pretraining text).

    python examples/make_arithmetic_data.py --out data/arithmetic [--seed 0] [--val-size 200]

Then e.g. `rlhf preprocess --input data/arithmetic/pretrain.jsonl --output-prefix data/arithmetic/pt
--tokenizer MODEL_DIR --append-eod` for pretraining, or `--sft --seq-length 64` on sft_train.jsonl.
"""

from __future__ import annotations

import argparse
import sys

from rlhf.data.arithmetic import write_arithmetic_data
from rlhf.errors import UserError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    parser.add_argument("--val-size", type=int, default=200, help="held-out (a, b) pairs")
    args = parser.parse_args(argv)
    try:
        paths = write_arithmetic_data(args.out, seed=args.seed, val_size=args.val_size)
    except UserError as e:
        print(f"make_arithmetic_data: error: {e}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        with open(path) as f:
            print(f"{name}: {path} ({sum(1 for _ in f)} records)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
