"""Whether model-written code passes its tests, decided where the code cannot reach the decision.

Each check runs two sandboxed processes (workers/sandbox/verdict_harness.py): the CANDIDATE runs the model's
code and nothing else, then answers calls; the CHECKER runs the trusted setup and tests, each name the
candidate defines replaced by a stub whose call this process relays to the candidate, and reports each test's
result. The verdict is read from the checker only. Values cross as plain data (None, bool, int, float, str,
bytes, and lists, tuples, sets, dicts of them) decoded in the checker, so the tests compare trusted builtins:
an object whose `__eq__` is always true cannot cross, and a candidate that prints a token, exits early or
writes protocol lines on any descriptor it owns can at most forge its own return values.

Limits: a test whose expected value is not plain data (an instance, a generator, a callable argument) fails;
the candidate's state does not persist across a restart; a name that shadows a builtin is never stubbed.
"""

from __future__ import annotations

import functools
import json
import os
import select
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from workers.sandbox.sandbox import SandboxLimits, _classify, _kill_group, finish, namespaces_available, spawn

HARNESS = Path(__file__).with_name("verdict_harness.py")
GRACE_S = 2.0  # beyond the candidates' wall clocks, for the checker to report
CHECKER_SESSION = 16  # checks one checker process serves in a row (run_checks)
STDERR_TAIL = 4096  # bytes of each process's stderr kept for the status and the detail


@dataclass(frozen=True)
class CodeCheck:
    """One candidate against its tests. `candidate`: the model's code (run alone); `setup`: trusted code the
    checker runs first (HumanEval's prompt and test, MBPP's setup); `tests`: statements, one verdict each;
    `stubs`: names always forwarded to the candidate (HumanEval's entry point, which the setup defines). Other
    names the tests read and neither the setup nor builtins define are asked of the candidate."""

    candidate: str
    tests: tuple[str, ...]
    setup: str = ""
    stubs: tuple[str, ...] = ()


@dataclass
class CheckResult:
    passed: list[bool]  # per test
    status: str  # "ok", or what went wrong: timeout, cpu_limit, memory, output_limit, exited, crashed,
    #              setup_failed (the sandbox), checker_error (the setup or the checker itself failed)
    detail: str = ""  # the first failure, for people
    wall_s: float = 0.0
    isolation: str = ""  # "namespaces" or "limits"
    errors: list[str] = field(default_factory=list)


def run_check(check: CodeCheck, limits: SandboxLimits | None = None) -> CheckResult:
    """Run one check; never raises for what the candidate does."""
    result, checker = _run_one(check, limits or SandboxLimits(), namespaces_available(), None)
    if checker is not None:
        checker.stop()
    return result


def run_checks(checks: Iterable[CodeCheck], limits: SandboxLimits | None = None, workers: int = 2,
               on_done: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
    """`run_check` over many checks, `workers` at a time (threads only relay); `on_done` is called with each
    result as it finishes (a progress bar). Each check gets a fresh candidate; a worker's checker serves up
    to CHECKER_SESSION checks in a row (fresh globals each), which saves a sandbox start per check."""
    todo = list(enumerate(checks))
    todo.reverse()
    results: list[CheckResult | None] = [None] * len(todo)
    lim, isolated, lock = limits or SandboxLimits(), namespaces_available(), threading.Lock()

    def work() -> None:
        checker, served = None, 0
        try:
            while True:
                with lock:
                    if not todo:
                        return
                    i, check = todo.pop()
                if checker is not None and served >= CHECKER_SESSION:
                    checker.stop()
                    checker, served = None, 0
                results[i], checker = _run_one(check, lim, isolated, checker)
                served = served + 1 if checker is not None else 0
                if on_done is not None:
                    on_done(results[i])  # type: ignore[arg-type]
        finally:
            if checker is not None:
                checker.stop()

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="verdict") as pool:
        for f in [pool.submit(work) for _ in range(max(1, workers))]:
            f.result()
    return [r for r in results if r is not None]


def _run_one(check: CodeCheck, limits: SandboxLimits, isolated: bool,
             checker: _Proc | None) -> tuple[CheckResult, _Proc | None]:
    """One check on `checker` (a fresh one when None); the result and the checker when it can serve again.
    A reused checker that fails to give a verdict gets the check again on a fresh one: its CPU budget was
    shared with earlier checks, so the failure is not surely this candidate's doing."""
    t0 = time.monotonic()
    relay = _Relay(check, limits, isolated, checker)
    result = relay.run()
    if checker is not None and not relay.done:
        return _run_one(check, limits, isolated, None)
    result.wall_s = round(time.monotonic() - t0, 3)
    result.isolation = "namespaces" if isolated else "limits"
    return result, relay.reusable


class _Proc:
    """One sandboxed harness process: non-blocking pipes, an outbox for its stdin, lines from its stdout."""

    def __init__(self, material: dict[str, Any] | None, limits: SandboxLimits, isolated: bool,
                 deadline: float) -> None:
        self.proc, self.base = spawn(_harness(), limits, isolated)
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr
        self.fd_in, self.fd_out, self.fd_err = (self.proc.stdin.fileno(), self.proc.stdout.fileno(),
                                                self.proc.stderr.fileno())
        for fd in (self.fd_in, self.fd_out, self.fd_err):
            os.set_blocking(fd, False)
        self.deadline, self.cap = deadline, limits.max_output_bytes
        self.outbox = bytearray(json.dumps(material).encode() + b"\n" if material else b"")
        self.inbox, self.err = bytearray(), bytearray()
        self.out_open = self.in_open = self.err_open = True
        self.oom_kills = 0

    def send(self, line: bytes) -> None:
        self.outbox += line if line.endswith(b"\n") else line + b"\n"

    def flush(self) -> None:
        while self.outbox and self.in_open:
            try:
                n = os.write(self.fd_in, self.outbox)
            except BlockingIOError:
                return
            except (BrokenPipeError, OSError):
                self.in_open = False
                self.outbox.clear()
                return
            del self.outbox[:n]

    def read_out(self) -> list[bytes] | None:
        """Complete lines read from stdout; None when a line runs past the output cap."""
        try:
            chunk = os.read(self.fd_out, 1 << 16)
        except BlockingIOError:
            return []
        if not chunk:
            self.out_open = False
            return []
        self.inbox += chunk
        *lines, rest = bytes(self.inbox).split(b"\n")
        self.inbox = bytearray(rest)
        if len(rest) > self.cap or any(len(x) > self.cap for x in lines):
            return None
        return lines

    def read_err(self) -> None:
        try:
            chunk = os.read(self.fd_err, 1 << 16)
        except BlockingIOError:
            return
        if not chunk:
            self.err_open = False
        self.err = (self.err + chunk)[-STDERR_TAIL:]

    def stop(self) -> int | None:
        """End the call as the sandbox ends its own (everything the code started), reap the launcher, remove
        its folder and cgroup (`oom_kills`: processes the kernel killed for its memory bound); its exit code."""
        _kill_group(self.proc)
        try:
            rc = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            rc = None
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass
        self.oom_kills, _ = finish(self.proc, self.base)
        return rc


@functools.cache
def _harness() -> str:
    return HARNESS.read_text()


def _why_ended(rc: int | None, stderr: str, oom_kills: int) -> str:
    """How a harness process ended, in the sandbox's words, except that a clean exit is "exited" and any
    other end "crashed" (a harness is meant to be killed, not to finish)."""
    status = "memory" if oom_kills > 0 else _classify(rc, stderr)
    return {"ok": "exited", "error": "crashed"}.get(status, status)


class _Relay:
    """Relays the checker's calls to the candidate and the replies back, each candidate under its wall
    clock. A candidate that dies or hangs is killed; the call waiting on it fails, and the next test's call
    starts a fresh one (at most one per test), so one test's hang or crash does not hide the others."""

    def __init__(self, check: CodeCheck, limits: SandboxLimits, isolated: bool, checker: _Proc | None) -> None:
        self.check, self.limits, self.isolated = check, limits, isolated
        self.given = checker
        self.reusable: _Proc | None = None  # after the run: the checker, when it can serve another check
        self.n = max(1, len(check.tests))
        self.results: dict[int, bool] = {}
        self.errors: list[str] = []
        self.status = "ok"
        self.detail = ""
        self.done = False
        self.pending: Any = None  # the id of the call the candidate owes a reply to
        self.starts = 0
        self.candidate: _Proc | None = None

    def _start_candidate(self) -> None:
        self.starts += 1
        self.candidate = _Proc({"role": "candidate", "code": self.check.candidate}, self.limits, self.isolated,
                               time.monotonic() + self.limits.wall_s)

    def _note(self, status: str, detail: str) -> None:
        if self.status == "ok":
            self.status, self.detail = status, detail

    def _drop_candidate(self, status: str | None = None) -> None:
        """Kill the candidate; answer the call it owed with an error."""
        cand = self.candidate
        assert cand is not None
        rc = cand.stop()
        stderr = cand.err.decode(errors="replace")
        why = status or _why_ended(rc, stderr, cand.oom_kills)
        self._note(why, f"candidate {why} (exit {rc}): {stderr.strip()[-300:]}")
        self.candidate = None
        if self.pending is not None:
            self._reply({"id": self.pending, "error": "CandidateError", "message": f"the candidate {why}"})

    def _reply(self, msg: dict[str, Any]) -> None:
        self.pending = None
        self.checker.send(json.dumps(msg).encode())

    def _on_checker_line(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            return
        if "call" in msg:
            call = msg["call"]
            if self.candidate is None and self.starts < self.n:
                self._start_candidate()
            if self.candidate is None:
                self._reply({"id": call["id"], "error": "CandidateError", "message": "the candidate is gone"})
                return
            self.pending = call["id"]
            self.candidate.send(json.dumps(call).encode())
        elif "result" in msg:
            self.results[int(msg["result"])] = msg["passed"] is True
            if msg["passed"] is not True:
                self.errors.append(f"test {msg['result']}: {msg.get('error')}: {msg.get('message', '')}"[:400])
        elif "setup_error" in msg:
            e = msg["setup_error"]
            self._note("checker_error", f"the checker's setup raised {e.get('error')}: {e.get('message')}")
        elif msg.get("done"):
            self.done = True

    def run(self) -> CheckResult:
        deadline = time.monotonic() + self.limits.wall_s * self.n + GRACE_S
        if self.given is None:  # its CPU limit covers a session of checks; each has its own wall clock
            session = replace(self.limits, cpu_s=self.limits.cpu_s * CHECKER_SESSION)
            self.given = _Proc({"role": "checker"}, session, self.isolated, deadline)
        self.checker = checker = self.given
        rc = None
        checker.send(json.dumps({"setup": self.check.setup, "tests": list(self.check.tests),
                                 "stubs": list(self.check.stubs)}).encode())
        try:
            self._start_candidate()
            self._loop(deadline)
        finally:
            if self.candidate is not None:
                self.candidate.stop()
            if self.done and checker.out_open and checker.in_open and self.status != "checker_error":
                self.reusable = checker
            else:
                rc = checker.stop()
        if not self.done:
            stderr = checker.err.decode(errors="replace")
            why = "timeout" if time.monotonic() >= deadline else _why_ended(rc, stderr, checker.oom_kills)
            self._note("checker_error" if why in ("exited", "crashed") else why,
                       f"the checker gave no verdict ({why}, exit {rc}): {stderr.strip()[-300:]}")
        passed = [self.results.get(i, False) for i in range(len(self.check.tests))]
        return CheckResult(passed, self.status, self.detail, errors=self.errors)

    def _loop(self, deadline: float) -> None:
        while not self.done:
            now = time.monotonic()
            cand = self.candidate
            if now >= deadline:
                return
            if cand is not None and now >= cand.deadline:
                self._drop_candidate("timeout")
                continue
            if cand is not None and not cand.out_open:  # it exited, or closed its protocol channel
                self._drop_candidate()
                continue
            if not self.checker.out_open:
                return
            self.checker.flush()
            if cand is not None:
                cand.flush()
            poll = select.poll()
            watched: dict[int, tuple[_Proc, str]] = {}
            for p in filter(None, (self.checker, cand)):
                for fd, is_open, what in ((p.fd_out, p.out_open, "out"), (p.fd_err, p.err_open, "err")):
                    if is_open:
                        poll.register(fd, select.POLLIN)
                        watched[fd] = (p, what)
                if p.outbox and p.in_open:
                    poll.register(p.fd_in, select.POLLOUT)
                    watched[p.fd_in] = (p, "in")
            wake = min(deadline, cand.deadline if cand is not None else deadline)
            for fd, _ in poll.poll(max(1, int((wake - now) * 1000))):
                p, what = watched[fd]
                if p is not self.checker and p is not self.candidate:  # the candidate was dropped meanwhile
                    continue
                if what == "err":
                    p.read_err()
                elif what == "in":
                    p.flush()
                elif p is self.checker:
                    lines = p.read_out()
                    if lines is None:
                        self._note("checker_error", "a checker line past the output cap")
                        return
                    for line in lines:
                        self._on_checker_line(line)
                elif p is self.candidate:
                    self._on_candidate_out(p)

    def _on_candidate_out(self, cand: _Proc) -> None:
        lines = cand.read_out()
        if lines is None:
            self._drop_candidate("output_limit")
            return
        for line in lines:
            if self.pending is not None:  # a line it sends unasked is dropped: it can only answer a call
                self.pending = None
                self.checker.send(line)
