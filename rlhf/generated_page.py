"""The command line of a generated docs page (the config reference, the API page): write it, or check it."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def page_main(render: Callable[[], str], page: Path, prog: str, source: str, argv: list[str] | None = None) -> int:
    """Write `render()` to the page (`--out`, default `page`), or with --check exit 1 when the checked-in page
    differs from what `source` gives now, naming the command that regenerates it."""
    ap = argparse.ArgumentParser(prog=f"python -m {prog}", description=f"generate {page.name} from {source}")
    ap.add_argument("--out", type=Path, default=page)
    ap.add_argument("--check", action="store_true", help=f"exit 1 when --out differs from {source}")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.is_file() or args.out.read_text() != text:
            print(f"{args.out} is out of date with {source}: run `python -m {prog}`")
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0
