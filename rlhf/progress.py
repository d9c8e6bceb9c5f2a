"""The console progress bar every command shows (training steps, evaluation items): tqdm on stderr, redrawn
at most every 5 s off a terminal (a log file, CI) rather than on every update."""

from __future__ import annotations

import sys
from typing import Any


def progress_bar(total: int | None, desc: str, initial: int = 0, unit: str = "it", enabled: bool = True,
                 leave: bool = True) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                mininterval=0.1 if sys.stderr.isatty() else 5.0, disable=not enabled, leave=leave)
