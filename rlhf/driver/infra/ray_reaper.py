"""Ends an embedded Ray's processes when the driver that started them dies without stopping them.

Ray ties its GCS and raylet to the driver (a parent-death signal), but the dashboard and runtime-env
agents the raylet starts outlive a SIGKILLed or OOM-killed driver by about a minute, and the driver's
weight-sync files and scratch folder stay behind until the next start. The driver starts this script
right after `ray.init` (`start_reaper`), in its own session so that a signal to the driver's process
group does not reach it, and writes one JSON line: the processes Ray started (pid and start time, so a
reused pid is never hit) and the paths to remove. The script then waits for end-of-file on its stdin,
which comes when the driver closes the pipe (a normal stop) or dies (the kernel closes it), and kills
whichever of those processes still run and removes the paths.

Standalone on purpose: run by path, it imports the standard library and psutil only, nothing of the
driver's, so it starts in a fraction of a second.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil  # type: ignore[import-untyped]


def processes_of(pid: int, include_self: bool = False) -> list[list[float]]:
    """[pid, start time] of every live descendant of `pid` (and of `pid` itself with `include_self`): what
    the reaper should end with it. Empty when `pid` has already exited."""
    out: list[list[float]] = []
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)] if include_self else root.children(recursive=True)
    except psutil.Error:
        return out
    for proc in procs:
        try:
            out.append([proc.pid, proc.create_time()])
        except psutil.Error:
            continue
    return out


def start_reaper(processes: list[list[float]], remove: list[str]) -> subprocess.Popen[bytes]:
    """Start the reaper for `processes` ([pid, start time]) and `remove` (paths or glob patterns); close
    its stdin (`stop_reaper`) to let it act while the driver still lives."""
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            close_fds=True)
    assert proc.stdin is not None
    proc.stdin.write((json.dumps({"processes": processes, "remove": remove}) + "\n").encode())
    proc.stdin.flush()
    return proc


def stop_reaper(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """Let the reaper end what is left now and wait for it (it is killed past `timeout_s`)."""
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def reap(processes: list[list[float]], remove: list[str]) -> list[int]:
    """SIGKILL each listed process that still runs with the same start time; remove the paths. Returns the
    pids killed."""
    killed = []
    for pid, started in processes:
        try:
            proc = psutil.Process(int(pid))
            if abs(proc.create_time() - started) > 0.01:
                continue  # the pid was reused by another process
            proc.send_signal(signal.SIGKILL)
            killed.append(int(pid))
        except psutil.Error:
            continue
    for pattern in remove:
        for path in glob.glob(pattern):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass
    return killed


def main() -> None:
    spec = json.loads(sys.stdin.readline() or "{}")
    sys.stdin.read()  # returns at end-of-file: the driver stopped us or died
    reap(spec.get("processes", []), spec.get("remove", []))


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is the driver's to handle
    main()
