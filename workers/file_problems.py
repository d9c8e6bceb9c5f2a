"""File problems a user can fix (full disk, read-only folder, truncated or corrupt file), named at the source.

Readers and writers wrap the calls that touch a file in `file_errors(path)` (or raise `FileProblem`
themselves), so the error names the file and the cause in words; the CLI prints it as one line with exit
code 2. Only the causes listed here are translated: any other OSError keeps its traceback (it is a bug or an
unexpected system state, and hiding it would not help). Light on purpose: no torch import.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# errno -> the cause as the message says it.
OS_CAUSES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied (read-only folder?)",
    errno.EPERM: "operation not permitted",
}
# Raised by the readers below when a file ends early or holds garbage.
TRUNCATED = (EOFError, pickle.UnpicklingError)
# torch.save's zip writer reports a short write (a full disk) only as a RuntimeError with one of these.
_SHORT_WRITE = ("unexpected pos", "file write failed")
_NEARLY_FULL = 1 << 20  # bytes free below which a short write is put down to a full disk


_PARTIAL = re.compile(r"(^|/)\.([^/]+)\.partial-\d+(?=/|$)")


def partial_name(path: str | Path) -> Path:
    """The temporary name an output `path` is written under until complete (then renamed): hidden, next to
    it (same file system, so the rename is atomic), marked partial and unique to this process."""
    p = Path(path)
    return p.with_name(f".{p.name}.partial-{os.getpid()}")


def output_name(path: str | Path) -> str:
    """`path` with any partial_name component turned back into the output name the user gave."""
    return _PARTIAL.sub(r"\1\2", str(path))


class FileProblem(Exception):
    """A file could not be read or written for a reason outside the program: `path` and `cause` say which
    file and why ("no space left on device", "truncated", "read-only file system")."""

    def __init__(self, path: str | Path, cause: str) -> None:
        super().__init__(path, cause)
        self.path = output_name(path)
        self.cause = cause

    def __str__(self) -> str:
        return f"{self.path}: {self.cause}"


def os_cause(exc: BaseException) -> str | None:
    """The cause in words of an OSError whose errno is one a user can fix, else None."""
    return OS_CAUSES.get(exc.errno) if isinstance(exc, OSError) and exc.errno is not None else None


def _short_write_cause(exc: BaseException, path: str | Path) -> str | None:
    """The cause of a RuntimeError that is torch's report of a short write, else None."""
    if not isinstance(exc, RuntimeError) or not any(s in str(exc) for s in _SHORT_WRITE):
        return None
    import shutil

    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    full = shutil.disk_usage(folder).free < _NEARLY_FULL
    return "no space left on device" if full else f"the write came up short ({str(exc).splitlines()[0]})"


def _unwrap(exc: BaseException) -> BaseException:
    """The first rank's original exception inside torch.distributed.checkpoint's CheckpointException."""
    failures = getattr(exc, "failures", None)  # {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))
        return inner[0] if isinstance(inner, tuple) else inner
    return exc


@contextmanager
def file_errors(path: str | Path, action: str = "write", what: str = "file") -> Iterator[None]:
    """Turn a full disk, a read-only or forbidden folder (OSError with a listed errno) and, when reading, a
    truncated `what` (EOFError, UnpicklingError, also inside a dist-checkpoint CheckpointException) raised
    inside the block into a FileProblem naming `path` (or the OSError's own file name)."""
    try:
        yield
    except FileProblem:
        raise
    except BaseException as e:  # CheckpointException derives from BaseException; anything unlisted is re-raised
        inner = _unwrap(e)
        cause = os_cause(inner) or (_short_write_cause(inner, path) if action == "write" else None)
        if cause is not None:
            raise FileProblem(getattr(inner, "filename", None) or path, f"cannot {action}: {cause}") from e
        if action == "read" and isinstance(inner, TRUNCATED):
            detail = f"{type(inner).__name__}: {inner}" if str(inner) else type(inner).__name__
            raise FileProblem(path, f"truncated or corrupt {what} ({detail})") from e
        raise
