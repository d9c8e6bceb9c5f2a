"""Run untrusted Python code (model-written code, code-execution rewards, the `python` tool) in a sandbox.

The isolation is done by `jail.py` in the child (namespaces, a private read-only root, resource limits, an
unprivileged user); this side writes the code into a throwaway directory, enforces the wall clock and the
output cap, kills everything the code started and classifies the outcome. Nothing here raises for anything the
code does: every failure is a `SandboxResult` with a status.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

JAIL = Path(__file__).with_name("jail.py")
JAIL_UID_BASE = 200_000  # started as root, each sandbox runs as its own uid above this
STATUSES = ("ok", "error", "timeout", "cpu_limit", "memory", "output_limit", "setup_failed")


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run. `memory_mb` bounds the address space; `max_output_bytes` stdout and stderr together."""

    wall_s: float = 10.0
    cpu_s: float = 5.0
    memory_mb: int = 512
    max_procs: int = 16
    max_files: int = 64
    max_file_bytes: int = 16 << 20
    max_output_bytes: int = 1 << 20


@dataclass
class SandboxResult:
    status: str  # one of STATUSES
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    isolation: str  # "namespaces" or "limits" (the kernel refused namespaces)


log = logging.getLogger(__name__)


@functools.cache
def namespaces_available() -> bool:
    """Whether this kernel lets us create the sandbox's namespaces (probed once with a trivial run, whose
    outcome is logged: the isolation level every later run gets)."""
    probe = _run("pass", SandboxLimits(wall_s=20), stdin="", isolated=True)
    if probe.status == "ok":
        log.info("sandbox isolation: namespaces (no network, private PID space and read-only root) plus limits")
        return True
    log.warning("sandbox isolation: LIMITS ONLY. The kernel refused namespaces (%s), so sandboxed code runs "
                "without network isolation or a private file system: only resource limits, a scrubbed "
                "environment and its own directory contain it", (probe.stderr.strip() or probe.status)[-200:])
    return False


def run_code(code: str, limits: SandboxLimits | None = None, stdin: str = "") -> SandboxResult:
    """Run `code` as a Python script (standard library only) in the sandbox; never raises for what it does."""
    return _run(code, limits or SandboxLimits(), stdin, isolated=namespaces_available())


def run_many(codes: Iterable[str], limits: SandboxLimits | None = None, workers: int = 2,
             on_done: Callable[[SandboxResult], None] | None = None) -> list[SandboxResult]:
    """`run_code` over many scripts, `workers` at a time (each run is a process; threads only wait);
    `on_done` is called with each result as it finishes (a progress bar)."""
    def one(code: str) -> SandboxResult:
        result = run_code(code, limits)
        if on_done is not None:
            on_done(result)
        return result

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="sandbox") as pool:
        return list(pool.map(one, codes))


def _run(code: str, limits: SandboxLimits, stdin: str, isolated: bool) -> SandboxResult:
    t0 = time.monotonic()
    proc, base = spawn(code, limits, isolated)
    try:
        out, err, killed_for = _communicate(proc, stdin.encode(), limits)
        rc = proc.returncode
    finally:
        shutil.rmtree(base, ignore_errors=True)
    wall = time.monotonic() - t0
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    status = killed_for or _classify(rc, stderr)
    return SandboxResult(status, rc, stdout, stderr, round(wall, 3), "namespaces" if isolated else "limits")


def spawn(code: str, limits: SandboxLimits, isolated: bool) -> tuple[subprocess.Popen, Path]:
    """Start `code` in the sandbox with piped stdin, stdout and stderr; returns the launcher process and the
    throwaway folder the caller removes when the process is done. The caller owns the wall clock."""
    base = Path(tempfile.mkdtemp(prefix="rlhf-sandbox-"))
    try:
        work = base / "work"
        work.mkdir()
        (work / "main.py").write_text(code)
        uid, gid = os.getuid(), os.getgid()
        if uid == 0 and (isolated or _world_readable_python()):
            uid = gid = JAIL_UID_BASE + os.getpid() % 50_000 * 16 + _next_slot()
            os.chown(work, uid, gid)
            os.chown(work / "main.py", uid, gid)
        nproc = limits.max_procs + (_tasks_of(uid) if uid == os.getuid() else 0)
        spec = {**asdict(limits), "max_procs": nproc, "work": str(work), "root": str(base / "root"), "uid": uid,
                "gid": gid, "isolated": isolated, "python": _python()}
        proc = subprocess.Popen(
            [_python(), "-I", "-S", "-B", str(JAIL), json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={}, cwd=str(base),
            start_new_session=True)
    except BaseException:
        shutil.rmtree(base, ignore_errors=True)
        raise
    return proc, base


def _communicate(proc: subprocess.Popen, data: bytes, limits: SandboxLimits) -> tuple[bytes, bytes, str | None]:
    """Feed stdin, collect output up to the cap; kill the process group at the wall clock or the cap."""
    assert proc.stdin and proc.stdout and proc.stderr
    try:
        proc.stdin.write(data)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + limits.wall_s
    killed_for = None
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
            killed_for = "timeout"
            break
        for key, _ in sel.select(timeout=min(left, 0.5)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            bufs[key.fd] += chunk
        if sum(len(b) for b in bufs.values()) > limits.max_output_bytes:
            killed_for = "output_limit"
            break
    sel.close()
    if killed_for:
        _kill_group(proc)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        proc.wait(timeout=10)
    cap = limits.max_output_bytes
    return bytes(bufs[out_fd][:cap]), bytes(bufs[err_fd][:cap]), killed_for


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher's process group; in the namespace case its death takes the PID namespace down."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _classify(rc: int | None, stderr: str) -> str:
    if rc == 0:
        return "ok"
    if rc == 125 and "sandbox setup failed" in stderr:
        return "setup_failed"
    if rc in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return "cpu_limit"
    if "MemoryError" in stderr:
        return "memory"
    return "error"


def _tasks_of(uid: int) -> int:
    """Threads the user runs now: RLIMIT_NPROC counts them all, so a sandbox sharing the user's uid (not
    started as root) gets its `max_procs` on top of them."""
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return n


_slot = 0
_slot_lock = threading.Lock()  # run_many and the agent loop's tool threads call _run concurrently


def _next_slot() -> int:
    global _slot
    with _slot_lock:
        _slot = (_slot + 1) % 16
        return _slot


def _python() -> str:
    """The base interpreter (not a virtualenv's link to it): the sandbox runs it with -I -S."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def _world_readable_python() -> bool:
    """Whether an unprivileged user can run the interpreter (every folder on its path is world-searchable)."""
    path = Path(_python())
    return all(os.stat(p).st_mode & 0o001 for p in path.parents)
