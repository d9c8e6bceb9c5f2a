"""Ordered chunked map over a stream, in-process (workers=1) or in a multiprocessing Pool (bounded imap)."""

from __future__ import annotations

import multiprocessing as mp
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any, TypeVar

from rlhf.errors import UserError

T = TypeVar("T")
R = TypeVar("R")


def chunked(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """Lists of up to `size` consecutive items, consuming `items` lazily."""
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


def imap_chunks(
    fn: Callable[[list[T]], R],
    items: Iterable[T],
    workers: int,
    initializer: Callable[..., None],
    initargs: tuple[Any, ...],
    chunk_size: int = 64,
) -> Iterator[R]:
    """Yield `fn(chunk)` for consecutive chunks of `items`, in input order; the input is streamed.

    workers=1 runs in this process; more uses a Pool whose workers run `initializer(*initargs)` first.
    """
    if workers < 1:
        raise UserError(f"--workers must be >= 1, got {workers}")
    chunks = chunked(items, chunk_size)
    if workers == 1:
        initializer(*initargs)
        yield from map(fn, chunks)
        return
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context("spawn")
    max_in_flight = 4 * workers
    with ctx.Pool(workers, initializer=initializer, initargs=initargs) as pool:
        # Pool.imap would drain the whole input into its task queue; a bounded window of async tasks
        # keeps memory flat on large files while results still come back in input order.
        pending: deque = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(fn, (chunk,)))
            if len(pending) >= max_in_flight:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
