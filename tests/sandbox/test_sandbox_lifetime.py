"""Sandboxed processes die with their caller, and one call's memory is bounded in total: real launchers,
real namespaces or the limits-only fallback, real processes found from outside by a unique marker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers.procs import marked, wait_for, world_readable_python
from workers.sandbox import SandboxLimits, reaper, sandbox
from workers.sandbox.sandbox import _run

REPO = str(Path(__file__).resolve().parents[2])


def _sleepers_code(marker: str) -> str:
    """Sandboxed code that leaves three sleeping processes named by `marker`: a forked child, a daemon
    (double fork and setsid) and itself; they ignore SIGTERM and SIGINT and use no CPU."""
    return f"""
import os, signal
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
argv = ["sleep", "{marker}"]
if os.fork() == 0:
    os.execv("/bin/sleep", argv)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sleep", argv)
    os._exit(0)
os.wait()
os.execv("/bin/sleep", argv)
"""


CALLER = """
import sys
from concurrent.futures import ThreadPoolExecutor
from workers.sandbox import sandbox
from workers.sandbox.sandbox import SandboxLimits, _run
isolated, python, code = sys.argv[1] == "namespaces", sys.argv[2], sys.argv[3]
if python:
    sandbox._python = lambda: python
with ThreadPoolExecutor(1) as pool:  # started from a pool thread, as run_many does
    r = pool.submit(_run, code, SandboxLimits(wall_s=600, cpu_s=60), "", isolated).result()
print(r, flush=True)
"""


@pytest.mark.parametrize("isolation", ["namespaces", "limits"])
def test_sigkill_of_the_caller_leaves_nothing_it_started(isolation):
    """The caller (a reward process, the driver) is SIGKILLed while its sandboxed code sleeps, with a forked
    child and a setsid'd daemon: 5 s later none of them is alive."""
    python = ""
    if isolation == "namespaces" and not sandbox.namespaces_available():
        pytest.skip("this kernel refuses namespaces")
    if isolation == "limits" and os.getuid() == 0:
        python = world_readable_python() or pytest.skip("no interpreter an unprivileged user can run")
    marker = f"{7000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**9:09d}"  # a valid `sleep` duration
    caller = subprocess.Popen([sys.executable, "-c", CALLER, isolation, python, _sleepers_code(marker)],
                              cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert wait_for(lambda: len(marked(marker)) >= 3, 60), (marked(marker), caller.poll())
        caller.kill()
        caller.wait(timeout=10)
        wait_for(lambda: not marked(marker), 5)
        alive = marked(marker)
        assert alive == [], f"still alive 5 s after the caller died: {alive}"
    finally:
        caller.kill()
        caller.wait(timeout=10)
        for pid in marked(marker):
            os.kill(pid, signal.SIGKILL)


def run_here(code: str, limits: SandboxLimits, monkeypatch: pytest.MonkeyPatch) -> sandbox.SandboxResult:
    """`code` at this machine's isolation level; limits-only as root needs an interpreter another uid can
    run (skips without one)."""
    isolated = sandbox.namespaces_available()
    if not isolated and os.getuid() == 0:
        python = world_readable_python() or pytest.skip("no interpreter an unprivileged user can run")
        monkeypatch.setattr(sandbox, "_python", lambda: python)
    return _run(code, limits, "", isolated)


def test_timeout_kills_the_daemons_too(monkeypatch):
    """At the wall clock every process the code started dies, the setsid'd daemon included."""
    marker = f"{8000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**9:09d}"
    r = run_here(_sleepers_code(marker), SandboxLimits(wall_s=3), monkeypatch)
    assert r.status == "timeout", r
    wait_for(lambda: not marked(marker), 5)
    assert marked(marker) == []


def _pss_mb(pids: set[int]) -> float:
    """Proportional resident memory of `pids` together (shared pages counted once)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def test_memory_of_all_processes_of_a_call_is_bounded(monkeypatch):
    """Six children allocating 200 MB each against memory_mb=512: the call is stopped for memory, and their
    resident memory together, measured from outside, stays near 512 MB (it reached 1.2 GB before)."""
    launchers: list[int] = []
    real_spawn = sandbox.spawn

    def spawn(*args, **kwargs):
        proc, base = real_spawn(*args, **kwargs)
        launchers.append(proc.pid)
        return proc, base

    monkeypatch.setattr(sandbox, "spawn", spawn)
    code = """
import os, time
kids = []
for _ in range(6):
    pid = os.fork()
    if pid == 0:
        block = b"x" * (200 << 20)  # written, so resident
        time.sleep(3)
        os._exit(0)
    kids.append(pid)
for pid in kids:
    os.waitpid(pid, 0)
"""
    peak = [0.0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            if launchers:
                peak[0] = max(peak[0], _pss_mb(reaper.descendants(launchers[0])))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        r = run_here(code, SandboxLimits(wall_s=30, cpu_s=20, memory_mb=512, max_procs=16), monkeypatch)
    finally:
        done.set()
        sampler.join(timeout=5)
    assert r.status == "memory", r
    assert r.memory_bound.startswith(("cgroup", "rlimit")), r
    assert 0 < peak[0] <= 512 * 1.1, f"{peak[0]:.0f} MB resident at the peak against memory_mb=512 ({r.memory_bound})"


def test_sandboxed_code_is_the_first_oom_victim(monkeypatch):
    """oom_score_adj 1000: the kernel kills sandboxed code before the training workers."""
    r = run_here("print(open('/proc/self/oom_score_adj').read())", SandboxLimits(), monkeypatch)
    assert r.status == "ok" and r.stdout.strip() == "1000", r
