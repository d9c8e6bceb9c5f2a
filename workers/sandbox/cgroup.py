"""A memory cgroup for one untrusted process tree (a sandbox call, a reward process): the kernel bounds the
resident memory of all its processes together, and its OOM killer picks a victim inside the group only.

Used where this process may create and fill one: as root, under its own cgroup (cgroup v2 with the memory
controller delegated, else the v1 memory hierarchy). Elsewhere `create` returns None and the callers fall back
to per-process address-space limits. Standard library only: the sandbox launcher (jail.py) imports it too.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import signal
import time
from dataclasses import dataclass

PREFIX = "rlhf-"
_names = itertools.count()


@dataclass(frozen=True)
class MemoryCgroup:
    """One cgroup directory: `version` 1 or 2, `limit_mb` its bound on the group's resident memory."""

    path: str
    version: int
    limit_mb: int

    @property
    def procs_file(self) -> str:
        """Writing a pid (or "0": the writer) here moves that process into the group."""
        return os.path.join(self.path, "cgroup.procs")

    def oom_kills(self) -> int:
        """Processes the kernel killed in this group for going over the bound (0 when unreadable)."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        return _field(os.path.join(self.path, name), "oom_kill")

    def peak_mb(self) -> float | None:
        """The group's highest memory use so far, where the kernel keeps it."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            with open(os.path.join(self.path, name)) as f:
                return int(f.read().split()[0]) / (1 << 20)
        except (OSError, ValueError, IndexError):
            return None

    def pids(self) -> list[int]:
        try:
            with open(self.procs_file) as f:
                return [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            return []

    def kill_all(self, timeout_s: float = 5.0) -> None:
        """SIGKILL every process in the group, until it is empty or `timeout_s` has passed."""
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)

    def remove(self, timeout_s: float = 5.0) -> None:
        """Kill what is left in the group and delete it (a no-op once it is gone)."""
        if not os.path.isdir(self.path):
            return
        self.kill_all(timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:  # EBUSY while the last killed process is being torn down
                if time.monotonic() > deadline:
                    return
                time.sleep(0.02)


def _field(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _mounts() -> list[tuple[str, str, str, str]]:
    """(mount root, mount point, fs type, super options) of each mount in /proc/self/mountinfo."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if len(fields) >= 5 and len(rest) >= 3:
                out.append((fields[3], fields[4], rest[0], rest[2]))
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per hierarchy: "" for v2, else the controller list ("memory", ...)."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _join(mount_root: str, mount_point: str, path: str) -> str | None:
    if mount_root != "/" and not path.startswith(mount_root):
        return None
    rel = path[len(mount_root):] if mount_root != "/" else path
    full = os.path.normpath(mount_point + "/" + rel.lstrip("/"))
    return full if os.path.isdir(full) else None


def _v2_parent(mounts: list[tuple[str, str, str, str]], own: dict[str, str]) -> str | None:
    for root, point, fstype, _ in mounts:
        if fstype != "cgroup2" or "" not in own:
            continue
        parent = _join(root, point, own[""])
        if parent is None:
            continue
        try:
            with open(os.path.join(parent, "cgroup.controllers")) as f:
                if "memory" not in f.read().split():
                    continue
            with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                enabled = "memory" in f.read().split()
            if not enabled:
                _write(os.path.join(parent, "cgroup.subtree_control"), "+memory")
        except OSError:  # no memory controller here, or processes in this group forbid delegating it
            continue
        return parent
    return None


def _v1_parent(mounts: list[tuple[str, str, str, str]], own: dict[str, str]) -> str | None:
    for root, point, fstype, options in mounts:
        if fstype == "cgroup" and "memory" in options.split(",") and "memory" in own:
            parent = _join(root, point, own["memory"])
            if parent and os.access(parent, os.W_OK):
                return parent
    return None


@functools.cache
def _parent() -> tuple[str, int] | None:
    """Where this process makes its groups: (directory, version); None where it cannot. Groups left by
    processes that died (a killed driver) are removed on the way."""
    if os.geteuid() != 0:
        return None
    try:
        mounts, own = _mounts(), _own_paths()
    except OSError:
        return None
    found = None
    v2 = _v2_parent(mounts, own)
    if v2 is not None:
        found = (v2, 2)
    else:
        v1 = _v1_parent(mounts, own)
        found = (v1, 1) if v1 is not None else None
    if found:
        _remove_stale(found[0])
    return found


def _remove_stale(parent: str) -> None:
    for name in os.listdir(parent):
        pid = name[len(PREFIX):].split("-", 1)[0]
        if name.startswith(PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(parent, name))


def mode() -> str:
    """How `create` bounds memory here: "cgroup v2", "cgroup v1" or "rlimit" (no group can be made)."""
    where = _parent()
    return f"cgroup v{where[1]}" if where else "rlimit"


def create(purpose: str, limit_mb: int) -> MemoryCgroup | None:
    """A new empty group bounded at `limit_mb` (no swap), or None where this process cannot make one."""
    where = _parent()
    if where is None:
        return None
    parent, version = where
    path = os.path.join(parent, f"{PREFIX}{os.getpid()}-{next(_names)}-{purpose}")
    limit = str(int(limit_mb) << 20)
    try:
        os.mkdir(path)
        if version == 2:
            _write(os.path.join(path, "memory.max"), limit)
            with contextlib.suppress(OSError):
                _write(os.path.join(path, "memory.swap.max"), "0")
        else:
            _write(os.path.join(path, "memory.limit_in_bytes"), limit)
            with contextlib.suppress(OSError):
                _write(os.path.join(path, "memory.memsw.limit_in_bytes"), limit)
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(path)
        return None
    return MemoryCgroup(path, version, int(limit_mb))
