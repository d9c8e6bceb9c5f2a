"""The `rlhf` command line: one subcommand per module in `rlhf/commands/`.

Each command module defines `register(subparsers)` which adds its parser and sets `func(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from rlhf.errors import UserError

# Command modules, imported lazily so `rlhf --help` stays fast. Add new commands here.
COMMAND_MODULES = [
    "rlhf.commands.init_model",
    "rlhf.commands.preprocess",
    "rlhf.commands.clean",
    "rlhf.commands.convert",
    "rlhf.commands.train",
    "rlhf.commands.generate",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description="Post-training of LLMs on Ray, megatron-core and vLLM.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"rlhf {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"rlhf {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
