"""`RewardPool`: a user's `module:function` called in separate processes, each call bounded in time: a reward
(`mode="reward"`: `fn(prompt, response, ground_truth)`) or an agent (`mode="agent"`: `fn(client, task)`
with an `openai.OpenAI` client the process builds, rlhf/driver/rl/openai_agents.py).

Calls run on `workers` processes at once (a slow reward does not serialize the batch). A call past
`timeout_s` is ended by killing its process, which is replaced; a process that dies (the function exited
or crashed) is replaced too. Requests and replies are JSON lines (rlhf/driver/rl/reward_worker.py): nothing
the user's code produces is unpickled in the driver. The processes ignore SIGINT and SIGTERM and run in
their own session, so a stop signal to the whole job (a terminal's Ctrl-C, Slurm, `ray job stop`) leaves
them to score the step the driver finishes; the driver ends them (`shutdown`), and they die with it.

Ending one ends everything the user's function started too (a subprocess, a fork, a setsid daemon): the
process's PID namespace or, where there is none, its whole process tree (reward_worker.py). Each process and
all it starts share a memory bound (`reward.memory_mb`: a memory cgroup where this process can make one, else
an address-space limit per process) and are the kernel's first OOM victims; a call that dies for memory is
an error outcome that says so, and the process is replaced.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from rlhf.errors import UserError
from workers.sandbox import cgroup, reaper

START_TIMEOUT_S = 120.0  # importing the user's module (it may import torch) on a loaded machine
KILL_TIMEOUT_S = 10.0  # for a killed process tree to be reaped


@dataclass
class Outcome:
    """One call's result: `value` (a finite float), or `kind` ("error" | "timeout", or "none": an agent
    returned None) and `message`."""

    value: float | None = None
    kind: str = "ok"
    message: str = ""


class _Proc:
    """One reward process and the bytes of its reply stream not yet split into lines."""

    def __init__(self, spec: str, memory_mb: int, mode: str = "reward", memory_name: str = "reward.memory_mb") -> None:
        self.memory_mb, self.memory_name = memory_mb, memory_name
        self.group = cgroup.create(mode, memory_mb)
        opts = {"caller": os.getpid(), "cgroup": self.group.path if self.group else None, "memory_mb": memory_mb,
                "mode": mode}
        # In its own session: a signal to the driver's process group (Ctrl-C, `ray job stop`) is the driver's
        # to handle, and the step it finishes before stopping still needs its rewards; the driver ends these.
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "rlhf.driver.rl.reward_worker", spec, json.dumps(sys.path), json.dumps(opts)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None, bufsize=0, start_new_session=True)
        assert self.popen.stdout is not None and self.popen.stdin is not None
        self.fd = self.popen.stdout.fileno()
        self.buf = b""
        self.task: tuple[int, float] | None = None  # (sample index, start time) of the call in flight

    def lines(self) -> list[dict[str, Any]] | None:
        """The complete reply lines now readable; None at end of stream (the process died)."""
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            return None
        self.buf += chunk
        *done, self.buf = self.buf.split(b"\n")
        return [json.loads(x) for x in done if x.strip()]

    def send(self, obj: dict[str, Any]) -> bool:
        try:
            assert self.popen.stdin is not None
            self.popen.stdin.write((json.dumps(obj, default=str) + "\n").encode())
            return True
        except (BrokenPipeError, OSError):
            return False

    def death(self, code: int) -> str:
        """Why the process exited with `code`: the memory bound when the kernel killed it for that."""
        if self.group is not None and self.group.oom_kills() > 0:
            return (f"killed for memory: its processes went over {self.memory_name}={self.memory_mb} "
                    f"(exit code {code})")
        return f"its process exited (code {code})"

    def kill(self) -> None:
        """SIGKILL the process and everything below it (what the user's function started), then remove its
        memory cgroup (which kills anything left in it)."""
        if self.popen.poll() is None:
            reaper.kill_tree(self.popen.pid)
        try:
            self.popen.wait(timeout=KILL_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # a process in uninterruptible sleep: leave it to the kernel
            pass
        if self.group is not None:
            self.group.remove()
        for f in (self.popen.stdin, self.popen.stdout):
            if f is not None:
                f.close()


class RewardPool:
    """`workers` processes of `spec`; `field` names the setting in messages (its `.timeout_s` and `.memory_mb`
    siblings too: `field="rollout.openai_agent"` names `rollout.agent_timeout_s`, `rollout.agent_memory_mb`)."""

    def __init__(self, spec: str, workers: int, timeout_s: float, memory_mb: int, mode: str = "reward",
                 field: str = "reward.fn") -> None:
        self.spec, self.workers, self.timeout_s, self.memory_mb = spec, max(1, workers), timeout_s, memory_mb
        self.mode, self.field = mode, field
        prefix = field.rsplit(".", 1)[0] + (".agent_" if mode == "agent" else ".")
        self.timeout_name, self.memory_name = prefix + "timeout_s", prefix + "memory_mb"
        self._procs: list[_Proc] = []

    def start(self) -> None:
        """Start one process now (the others start with the first batch): UserError if the function does
        not load within the start timeout."""
        if not self._procs:
            self._procs.append(self._start())

    def _start(self) -> _Proc:
        """A new process, once it has imported the function; UserError (one line) if it cannot."""
        proc = _Proc(self.spec, self.memory_mb, self.mode, self.memory_name)
        deadline = time.monotonic() + max(START_TIMEOUT_S, self.timeout_s)
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([proc.fd], [], [], max(0.0, left))
            if not ready:
                proc.kill()
                raise UserError(f"{self.field} {self.spec}: its process did not import the function within "
                                f"{max(START_TIMEOUT_S, self.timeout_s):g} s")
            lines = proc.lines()
            if lines is None:
                code = proc.popen.wait(timeout=KILL_TIMEOUT_S)
                why = proc.death(code)
                proc.kill()
                raise UserError(f"{self.field} {self.spec}: {why} before it was ready")
            for reply in lines:
                if reply.get("ready"):
                    return proc
                proc.kill()
                raise UserError(f"{self.field} {reply.get('error', self.spec)}")

    def _replace(self, proc: _Proc) -> None:
        proc.kill()
        self._procs[self._procs.index(proc)] = self._start()

    def score(self, samples: list[tuple[Any, ...]]) -> list[Outcome]:
        """One Outcome per call's arguments (a reward's `(prompt, response, ground_truth)`), in order."""
        while len(self._procs) < min(self.workers, len(samples)):
            self._procs.append(self._start())
        results: list[Outcome | None] = [None] * len(samples)
        todo = deque(range(len(samples)))
        while todo or any(p.task for p in self._procs):
            for proc in list(self._procs):
                while proc.task is None and todo:
                    i = todo.popleft()
                    if proc.send({"i": i, "args": list(samples[i])}):
                        proc.task = (i, time.monotonic())
                    else:  # died between calls: give the sample to its replacement
                        todo.appendleft(i)
                        self._replace(proc)
                        break
            busy = [p for p in self._procs if p.task]
            if not busy:
                continue
            wait = min(p.task[1] for p in busy if p.task) + self.timeout_s - time.monotonic()
            readable, _, _ = select.select([p.fd for p in busy], [], [], max(0.0, wait))
            now = time.monotonic()
            for proc in busy:
                assert proc.task is not None
                i, started = proc.task
                if proc.fd in readable:
                    lines = proc.lines()
                    if lines is None:
                        code = proc.popen.wait(timeout=KILL_TIMEOUT_S)
                        results[i] = Outcome(kind="error", message=proc.death(code))
                        proc.task = None
                        self._replace(proc)
                        continue
                    for reply in lines:
                        if reply.get("i") == i:
                            results[i] = _outcome(reply)
                            proc.task = None
                elif now - started >= self.timeout_s:
                    results[i] = Outcome(kind="timeout", message=f"took longer than {self.timeout_name}={self.timeout_s:g}")
                    proc.task = None
                    self._replace(proc)
        return [r if r is not None else Outcome(kind="error", message="no reply") for r in results]

    def shutdown(self) -> None:
        for proc in self._procs:
            proc.kill()
        self._procs = []


def _outcome(reply: dict[str, Any]) -> Outcome:
    if "value" in reply:
        return Outcome(value=float(reply["value"]))
    if reply.get("none"):
        return Outcome(kind="none")
    return Outcome(kind="error", message=str(reply.get("bad") or f"raised {reply.get('error')}"))
