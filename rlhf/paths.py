"""Output files and folders: refused when they would overwrite, written under a temporary name, renamed
into place only when complete (and removed on failure), so a failed or killed command never leaves
something that looks like finished output."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from rlhf.errors import UserError
from workers.file_problems import file_errors, partial_name


def _check_output_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"output path {out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not force:
        raise UserError(f"output directory {out} exists and is not empty (pass --force to overwrite)")


@contextmanager
def staged_output_dir(path: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield an empty temporary folder next to `path`; when the block succeeds it replaces `path` (an
    existing non-empty `path` is refused up front unless `force`, and kept until the new one is complete);
    when the block fails the temporary folder is removed."""
    out = Path(path)
    _check_output_dir(out, force)
    tmp = partial_name(out)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with file_errors(tmp, "create the folder"):
            tmp.mkdir(parents=True)
        yield tmp
        with file_errors(out, "replace"):
            if out.exists():
                shutil.rmtree(out)
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def staged_output_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to `path`, renamed to `path` when the block succeeds and removed when it
    fails; OSErrors of a full disk or a read-only folder inside the block name `path`."""
    out = Path(path)
    tmp = partial_name(out)
    try:
        with file_errors(out, "write"):
            yield tmp
            os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_writable(path: str | Path) -> None:
    """Raise unless a file can be created next to `path` (its folder exists and takes writes)."""
    out = Path(path)
    if not out.parent.is_dir():
        raise UserError(f"output folder {out.parent} does not exist")
    probe = partial_name(out)
    with file_errors(out, "write"):
        probe.touch()
    probe.unlink()
