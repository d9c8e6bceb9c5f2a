"""The polled wait of every group: the results of one call on several actors, with a deadline and fast failure.

Results are polled with `ray.wait` (never waited on one by one), so a rank that raises or dies ends the wait
within about a poll interval even while the other ranks are blocked, e.g. in a collective with the dead one.
What a failure or a timeout means is the caller's: it builds the exception from the indices involved.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray

POLL_S = 0.5

Failure = tuple[int, Exception]  # (index of the call in `refs`, what `ray.get` raised)
OnFailure = Callable[[list[Failure], list[int]], BaseException]
OnTimeout = Callable[[list[int]], BaseException]
OnReady = Callable[[int, Any, int], Any]  # (index, result, calls still running) -> the result to keep


def wait_all(refs: list, timeout_s: float, on_failure: OnFailure, on_timeout: OnTimeout,
             on_poll: Callable[[], None] | None = None, poll_s: float = POLL_S,
             on_ready: OnReady | None = None) -> list[Any]:
    """The results of `refs`, in order, within `timeout_s`.

    After the first poll on which some calls raised, `on_failure(failures, pending)` returns the exception
    to raise (`pending`: indices of the calls still running); at the deadline `on_timeout(pending)` does.
    `on_poll()` runs after every poll that leaves calls pending and may raise to stop waiting (e.g. when
    the sending side of a transfer failed). `on_ready(i, result, running)` sees each result as it arrives,
    while `running` calls are still at work, and returns what to keep (e.g. the samples of one engine,
    scored while the other engines still generate); it runs within the deadline's polling.
    """
    index = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending = list(refs)
    deadline = time.monotonic() + timeout_s
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise on_timeout([index[r] for r in pending])
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=min(remaining, poll_s))
        failures: list[Failure] = []
        for ref in ready:
            try:
                results[index[ref]] = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - handed to on_failure, which names the rank
                failures.append((index[ref], exc))
        if failures:
            raise on_failure(failures, [index[r] for r in pending])
        if on_ready is not None:
            for ref in ready:
                results[index[ref]] = on_ready(index[ref], results[index[ref]], len(pending))
        if on_poll is not None and pending:
            on_poll()
    return results


def settle(refs: list, indices: list[int], timeout_s: float) -> tuple[list[Failure], list[int]]:
    """Give the calls `indices` of `refs` up to `timeout_s` to finish; return the failures among those
    that did and the indices still running (after one rank failed: did the others fail too, or hang?)."""
    if not indices:
        return [], []
    ready, pending = ray.wait([refs[i] for i in indices], num_returns=len(indices), timeout=timeout_s)
    position = {refs[i]: i for i in indices}
    failures: list[Failure] = []
    for ref in ready:
        try:
            ray.get(ref)
        except Exception as exc:  # noqa: BLE001
            failures.append((position[ref], exc))
    return failures, [position[r] for r in pending]


def is_death(exc: BaseException) -> bool:
    """Whether a call failed because its actor died (rather than raised)."""
    return isinstance(exc, ray.exceptions.RayActorError)
