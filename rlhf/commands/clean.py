"""`rlhf clean`: strip, normalise whitespace, drop short and duplicate documents."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "clean",
        help="clean raw text (.txt, one doc per line) or jsonl before `rlhf preprocess`",
        description="Normalise whitespace, strip, and drop empty, short (--min-length characters) and, with "
        "--dedup-lines, exact-duplicate documents. The output has the input's format.",
    )
    p.add_argument("--input", required=True, help="input .txt (one document per line) or .jsonl")
    p.add_argument("--output", required=True, help="output file (same format as the input)")
    p.add_argument(
        "--dedup-lines",
        "--remove-duplicate-lines",
        dest="dedup",
        action="store_true",
        help="drop documents (lines of a .txt) that exactly repeat an earlier one after normalisation",
    )
    p.add_argument(
        "--min-length", type=int, default=0, help="drop documents shorter than this many characters"
    )
    p.add_argument("--json-key", default="text", help="jsonl text field (default: text)")
    p.add_argument("--force", action="store_true", help="replace an existing --output file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from rlhf.data.clean import clean_file
    from rlhf.errors import UserError

    if Path(args.output).exists() and not args.force:
        raise UserError(f"--output {args.output} exists; give --force to replace it, or another --output")
    stats = clean_file(
        args.input, args.output, min_length=args.min_length, dedup=args.dedup, json_key=args.json_key
    )
    print(stats.summary())
    if stats.first_malformed:
        print(f"first malformed line: {stats.first_malformed}", file=sys.stderr)
    print(f"wrote {args.output}")
    return 0
