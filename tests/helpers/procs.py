"""Processes seen from outside (the sandbox and reward-process tests): found by a marker in their command line,
polled for a condition, and an interpreter an unprivileged uid can run."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path


def world_readable_python() -> str | None:
    """An interpreter an unprivileged uid can run (what the limits-only path as root needs), or None."""
    from workers.sandbox import sandbox

    for candidate in (sandbox._python(), shutil.which("python3"), "/usr/bin/python3"):
        if not candidate or not os.path.exists(candidate):
            continue
        path = Path(os.path.realpath(candidate))
        if all(os.stat(p).st_mode & 0o001 for p in path.parents) and os.stat(path).st_mode & 0o001:
            return str(path)
    return None


def marked(marker: str) -> list[int]:
    """Pids of live (not zombie) processes whose command line holds `marker`."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def wait_for(pred: Callable[[], object], timeout_s: float) -> bool:
    """Poll `pred` until it is true or `timeout_s` has passed; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.1)
    return pred()
