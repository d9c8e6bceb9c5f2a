"""`importlib.metadata.packages_distributions()`, kept on disk between processes.

transformers calls it once per process while it imports (`transformers.utils.import_utils`), and it reads the
RECORD file of every installed distribution that lacks `top_level.txt`: about 48,000 paths parsed here, 1.3 s
of CPU in every Megatron worker, rollout engine and CLI process. The answer only changes when a distribution is
installed or removed, which adds or removes a `*.dist-info` folder and so changes the mtime of its sys.path
folder: the cache file is named after those mtimes (and the interpreter), so an install is a new file, never a
stale answer. Old files are never read again; each is about 9 KB. The file is JSON this module wrote, checked for its shape when read; anything else is ignored
and computed again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path


def cache_dir() -> Path:
    """Where the mapping is kept: $XDG_CACHE_HOME/rlhf, else ~/.cache/rlhf."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "rlhf"


def _holds_distributions(folder: str) -> bool:
    try:
        with os.scandir(folder) as entries:
            return any(e.name.endswith((".dist-info", ".egg-info")) for e in entries)
    except OSError:
        return False


def cache_key(paths: list[str]) -> str:
    """A name for the installed set seen through `paths`: the interpreter, and the path and mtime of each entry
    that holds distributions (a `*.dist-info` or `*.egg-info`) or is a file (a zip). Entries without any, such
    as a Ray worker's session folders, change nothing importlib finds, so they change no name; an entry that
    gains one enters the name."""
    parts = [sys.version]
    for entry in paths:
        folder = os.path.abspath(entry or ".")
        if os.path.isfile(folder) or _holds_distributions(folder):
            parts.append(f"{folder}:{os.stat(folder).st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def _read(path: Path) -> dict[str, list[str]] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and all(isinstance(k, str) and isinstance(v, list) and
                                        all(isinstance(d, str) for d in v) for k, v in data.items())
    return data if ok else None


def _write(path: Path, data: dict[str, list[str]]) -> None:
    """Write atomically (a reader sees the old file or the whole new one); a read-only home is no error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        pass


def packages_distributions(folder: Path | None = None,
                           compute: Callable[[], Mapping[str, list[str]]] | None = None) -> dict[str, list[str]]:
    """What `importlib.metadata.packages_distributions()` (or `compute`, the same function when that name is
    patched) returns for this sys.path, read from `folder` (default `cache_dir()`) when this installed set was
    seen before."""
    path = (folder or cache_dir()) / f"packages-distributions-{cache_key(list(sys.path))}.json"
    found = _read(path)
    if found is not None:
        return found
    mapping = {k: list(v) for k, v in (compute or importlib.metadata.packages_distributions)().items()}
    _write(path, mapping)
    return mapping
