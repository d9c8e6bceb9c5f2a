"""Tool calls and environment steps on daemon threads, each with a deadline, that nothing ever waits for past
it.

A `ThreadPoolExecutor` cannot abandon a stuck call: leaving its `with` block (or shutting it down) joins the
thread, and a stuck call holds one of its workers for good. Here each call gets a thread of its own when a
slot is free (`workers` at once); a call past its deadline is given up on: it is reported as timed out, its
slot is freed for the next call, and its thread (a daemon) is left to end on its own, never joined. So a
hung tool or environment costs its trajectory one timeout, not the rollout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class Call:
    """One `fn(*args)`: queued, then running on its own thread until it returns, raises or passes its deadline."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float, name: str) -> None:
        self.fn, self.args, self.timeout_s, self.name = fn, args, timeout_s, name
        self.deadline: float | None = None  # set when it starts
        self.value: Any = None
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self.timed_out = False
        self.started_at = self.ended_at = 0.0

    @property
    def resolved(self) -> bool:
        """Whether its outcome is known: it returned or raised, or it passed its deadline."""
        return self.finished.is_set() or self.timed_out

    def result(self) -> Any:
        """The return value; raises what it raised, or TimeoutError once it passed its deadline."""
        if self.timed_out:
            raise TimeoutError(f"no result within {self.timeout_s:g} s")
        if self.error is not None:
            raise self.error
        return self.value


class CallRunner:
    """Runs `Call`s on daemon threads, at most `workers` at once; a call past its deadline frees its slot."""

    def __init__(self, workers: int) -> None:
        self.workers = max(1, workers)
        self._queued: deque[Call] = deque()
        self._running: list[Call] = []
        self._wake = threading.Event()
        self.abandoned = 0  # calls given up on at their deadline

    def submit(self, fn: Callable[..., Any], *args: Any, timeout_s: float, name: str = "") -> Call:
        """Queue `fn(*args)`; `name` (the tool's, or the environment step's) is what a timeout warning names."""
        call = Call(fn, args, timeout_s, name or getattr(fn, "__name__", "a call"))
        self._queued.append(call)
        self.poll()
        return call

    def _start(self, call: Call) -> None:
        def body() -> None:
            try:
                call.value = call.fn(*call.args)
            except BaseException as e:  # noqa: BLE001 - the caller reads it as the call's outcome
                call.error = e
            call.ended_at = time.monotonic()
            call.finished.set()
            self._wake.set()

        call.started_at = time.monotonic()
        call.deadline = call.started_at + call.timeout_s
        self._running.append(call)
        threading.Thread(target=body, name=f"agent-call-{call.name}", daemon=True).start()

    def poll(self) -> None:
        """Retire finished and overdue calls, then start queued ones into the free slots."""
        now = time.monotonic()
        for call in list(self._running):
            if call.finished.is_set():
                self._running.remove(call)
            elif call.deadline is not None and now >= call.deadline:
                call.timed_out = True
                self._running.remove(call)
                self.abandoned += 1
                log.warning("%s did not return within %g s: given up on (its thread is left to end on its own)",
                            call.name, call.timeout_s)
        while self._queued and len(self._running) < self.workers:
            self._start(self._queued.popleft())

    def wait(self, max_s: float) -> None:
        """Block until a call finishes, the earliest deadline passes or `max_s` elapses, then `poll`."""
        deadlines = [c.deadline for c in self._running if c.deadline is not None]
        left = min([max_s, *(d - time.monotonic() for d in deadlines)])
        if left > 0:
            self._wake.wait(left)
        self._wake.clear()
        self.poll()

    @property
    def busy(self) -> bool:
        """Whether a call is queued or running (and not past its deadline)."""
        self.poll()
        return bool(self._queued or self._running)
