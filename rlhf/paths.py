"""Small helpers for output folders."""

from __future__ import annotations

import shutil
from pathlib import Path

from rlhf.errors import UserError


def prepare_output_dir(path: str | Path, force: bool = False) -> Path:
    """Create `path`; refuse an existing non-empty folder unless `force`, which empties it first."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UserError(f"output path {out} exists and is not a directory")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise UserError(f"output directory {out} exists and is not empty (pass --force to overwrite)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return out
