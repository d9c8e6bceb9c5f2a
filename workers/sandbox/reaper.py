"""Ending untrusted process trees: find every descendant of a process, freeze and kill them all, and notice
when the process that started us dies.

Standard library only: the sandbox launcher (jail.py, run as `python -I -S`) and the reward processes import
it too. Used with PR_SET_CHILD_SUBREAPER on the root, a daemonised grandchild (double fork, setsid) stays a
descendant, so nothing escapes the walk by re-parenting.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
_POLL_S = 0.5  # how often the caller is checked where pidfd_open is missing (kernels before 5.3)


def prctl(option: int, value: int) -> bool:
    """`prctl(option, value)`; False where the call failed."""
    try:
        return int(ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process in this /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # the command name may hold spaces and parentheses
        out[int(name)] = int(fields[1])
    return out


def descendants(root: int) -> set[int]:
    """The pids below `root` (children, their children, ...), `root` excluded."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def kill_descendants(root: int, rounds: int = 50) -> int:
    """SIGKILL every descendant of `root`; returns how many. They are stopped first, round after round until
    no new one appears, so a process forking while we look cannot leave a child behind."""
    stopped: set[int] = set()
    for _ in range(rounds):
        new = descendants(root) - stopped
        if not new:
            break
        for pid in new:
            _signal(pid, signal.SIGSTOP)
        stopped |= new
    for pid in stopped:
        _signal(pid, signal.SIGKILL)
    return len(stopped)


def kill_tree(root: int) -> None:
    """SIGKILL `root` and all its descendants."""
    _signal(root, signal.SIGSTOP)
    kill_descendants(root)
    _signal(root, signal.SIGKILL)


def watch(pid: int) -> int | None:
    """A pidfd of `pid` that becomes readable when it exits (None where the kernel has no pidfd_open).
    ProcessLookupError if it is gone already."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError) as e:
        if isinstance(e, ProcessLookupError):
            raise
        os.kill(pid, 0)  # ProcessLookupError when it is gone
        return None


def wait_child(child: int, caller: int, caller_fd: int | None) -> int | None:
    """Wait for our child `child` and return its wait status; None (child not reaped) if the caller (watched
    by `caller_fd`, or by polling whether it is still our parent) exits first."""
    try:
        child_fd: int | None = os.pidfd_open(child)
    except (AttributeError, OSError):
        child_fd = None
    fds = [fd for fd in (child_fd, caller_fd) if fd is not None]
    timeout = None if child_fd is not None and caller_fd is not None else _POLL_S
    try:
        while True:
            ready = select.select(fds, [], [], timeout)[0]
            if child_fd is None or child_fd in ready:
                pid, status = os.waitpid(child, 0 if child_fd is not None else os.WNOHANG)
                if pid:
                    return status
            if (caller_fd is not None and caller_fd in ready) or (caller_fd is None and os.getppid() != caller):
                return None
    finally:
        if child_fd is not None:
            os.close(child_fd)
