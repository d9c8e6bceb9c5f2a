"""Requests of concurrent agent sessions gathered into one engine call.

The engines are synchronous (`RolloutWorker.complete`, one call at a time): a dispatcher thread takes every
request queued while the previous call ran and sends them together, so sessions that call the model at the
same time share the engines' batch. Each request records the policy version its call ran on.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

log = logging.getLogger(__name__)

Backend = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]  # requests -> one result per request


class Batcher:
    """Runs `backend` on a daemon thread over the queued requests, at most `max_batch` a call; `version()`
    is read just before each call and returned with every result of it."""

    def __init__(self, backend: Backend, version: Callable[[], int], max_batch: int = 256) -> None:
        self.backend, self.version, self.max_batch = backend, version, max_batch
        self._queue: queue.Queue[tuple[dict[str, Any], Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="endpoint-batcher", daemon=True)
        self._thread.start()
        self.calls = 0

    def submit(self, request: dict[str, Any]) -> Future:
        """Queue one request; the future gives `(result, version)`, or the backend's exception."""
        fut: Future = Future()
        self._queue.put((request, fut))
        return fut

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            items = [first]
            while len(items) < self.max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                items.append(nxt)
            live = [(r, f) for r, f in items if f.set_running_or_notify_cancel()]
            if not live:
                continue
            try:
                version = self.version()
                results = self.backend([r for r, _ in live])
                self.calls += 1
            except BaseException as e:  # noqa: BLE001 - each waiting request gets the failure
                log.warning("endpoint: engine call failed: %s: %s", type(e).__name__, e)
                for _, f in live:
                    f.set_exception(e)
                continue
            for (_, f), res in zip(live, results):
                f.set_result((res, version))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5.0)
