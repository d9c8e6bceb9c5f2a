"""Run untrusted Python code (model-written code, code-execution rewards, the `python` tool) in a sandbox.

The isolation is done by `jail.py` in the child (namespaces, a private read-only root, resource limits, an
unprivileged user, a supervisor that ends everything when the caller dies); this side writes the code into a
throwaway directory, makes the call's memory cgroup where it can, enforces the wall clock and the output cap,
kills everything the code started and classifies the outcome. Nothing here raises for anything the code does:
every failure is a `SandboxResult` with a status.

Memory: `memory_mb` bounds the call's total. With a cgroup (`cgroup.mode()`), the kernel bounds the resident
memory of all its processes together, and each process's address space is capped at `memory_mb` too. Without
one, each process gets an equal share of `memory_mb` as its address-space limit and the process count is
capped so the shares add up to `memory_mb` (`RLIMIT_SHARE_MIN_MB` each at least, so fewer processes).
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

from workers.sandbox import cgroup, reaper

JAIL = Path(__file__).with_name("jail.py")
JAIL_UID_BASE = 200_000  # started as root, each sandbox runs as its own uid above this
STATUSES = ("ok", "error", "timeout", "cpu_limit", "memory", "output_limit", "setup_failed")
RLIMIT_SHARE_MIN_MB = 64  # without a cgroup: the smallest per-process share of memory_mb (a Python process)
STOP_GRACE_S = 3.0  # the supervisor's time to end the code's processes on SIGTERM before it is killed


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run. `memory_mb` bounds all its processes together (see the module docstring);
    `max_output_bytes` stdout and stderr together."""

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
    memory_bound: str = ""  # "cgroup v2 512 MB", "cgroup v1 512 MB" or "rlimit 8 x 64 MB" (what bounded memory_mb)


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
    if os.getuid() == 0 and not _world_readable_python():
        log.warning("sandbox: every run will be REFUSED: started as root without namespaces, and %s cannot be run "
                    "by an unprivileged user, so the code would run as root; install Python where every user "
                    "can run it or allow user namespaces", _python())
    return False


def memory_bound_mode() -> str:
    """How a sandbox call's `memory_mb` is bounded on this machine: "cgroup v2", "cgroup v1" or "rlimit"
    (per-process shares); logged once, like the isolation level."""
    mode = cgroup.mode()
    log.info("sandbox memory bound: %s", mode if mode != "rlimit" else
             "per-process address-space shares of memory_mb with a process-count cap (no writable cgroup)")
    return mode


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
        oom_kills, bound = finish(proc, base)
    wall = time.monotonic() - t0
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    status = killed_for or ("memory" if oom_kills > 0 else _classify(rc, stderr))
    return SandboxResult(status, rc, stdout, stderr, round(wall, 3), "namespaces" if isolated else "limits", bound)


def finish(proc: subprocess.Popen, base: Path) -> tuple[int, str]:
    """Clean up after a spawned call whose launcher has exited: (processes the kernel killed for the memory
    bound, how memory was bounded); removes the call's folder and any cgroup its launcher left behind."""
    try:
        return _memory_outcome(proc, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _memory_outcome(proc: subprocess.Popen, base: Path) -> tuple[int, str]:
    """(processes the kernel killed for the cgroup's bound, how memory was bounded) of a finished call. The
    supervisor leaves the count in outcome.json when it removes the cgroup; if it was killed first, the
    cgroup is read (and removed) here."""
    spec = json.loads(str(proc.args[-1]))  # type: ignore[index]
    if not spec.get("cgroup"):
        return 0, spec["memory_bound"]
    try:
        oom_kills = int(json.loads((base / "outcome.json").read_text())["oom_kills"])
    except (OSError, ValueError, KeyError, TypeError):
        group = cgroup.MemoryCgroup(spec["cgroup"], int(spec["cgroup_version"]), int(spec["memory_mb"]))
        oom_kills = group.oom_kills()
        group.remove()
    return oom_kills, spec["memory_bound"]


def spawn(code: str, limits: SandboxLimits, isolated: bool) -> tuple[subprocess.Popen, Path]:
    """Start `code` in the sandbox with piped stdin, stdout and stderr; returns the launcher process and the
    throwaway folder the caller removes when the process is done. The caller owns the wall clock; the
    launcher (a supervisor) ends everything the code started when the code's process exits, when it gets
    SIGTERM (`_kill_group`) and when this process dies. Started as root without namespaces and with an
    interpreter no other user can run, the launcher refuses to run the code (status setup_failed)."""
    base = Path(tempfile.mkdtemp(prefix="rlhf-sandbox-"))
    group = None
    try:
        work = base / "work"
        work.mkdir()
        (work / "main.py").write_text(code)
        uid, gid = os.getuid(), os.getgid()
        if uid == 0 and (isolated or _world_readable_python()):
            uid = gid = JAIL_UID_BASE + os.getpid() % 50_000 * 16 + _next_slot()
            os.chown(work, uid, gid)
            os.chown(work / "main.py", uid, gid)
            os.chmod(base, 0o711)  # the code's uid reaches its folder without listing the others
        group = cgroup.create("sandbox", limits.memory_mb)
        if group is not None:
            procs, per_proc_mb = limits.max_procs, limits.memory_mb
            bound = f"cgroup v{group.version} {limits.memory_mb} MB"
        else:
            procs = min(limits.max_procs, max(1, limits.memory_mb // RLIMIT_SHARE_MIN_MB))
            per_proc_mb = limits.memory_mb // procs
            bound = f"rlimit {procs} x {per_proc_mb} MB"
        nproc = procs + (_tasks_of(uid) if uid == os.getuid() else 0)
        spec = {**asdict(limits), "memory_mb": per_proc_mb, "max_procs": nproc, "work": str(work),
                "root": str(base / "root"), "uid": uid, "gid": gid, "isolated": isolated, "python": _python(),
                "caller": os.getpid(), "cgroup": group.path if group else None,
                "cgroup_version": group.version if group else 0, "memory_bound": bound}
        proc = subprocess.Popen(
            [_python(), "-I", "-S", "-B", str(JAIL), json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={}, cwd=str(base),
            start_new_session=True)
    except BaseException:
        if group is not None:
            group.remove()
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
    """End the call: SIGTERM to the launcher, which kills everything the code started (its descendants, its
    uid, its PID namespace and cgroup); if it is still there after `STOP_GRACE_S`, SIGKILL its whole tree
    and process group."""
    try:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=STOP_GRACE_S)
        return
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        pass
    reaper.kill_tree(proc.pid)
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
