"""A bounded pool of threads for a request's CPU work before the engine sees it (tokenization, chat
templating, the prompt safety screen), so that no request holds the event loop, and with it /health
and every other request's stream, for longer than it takes to hand the work over.

Tokenizing releases the GIL (`Tokenizer.encode` goes through `encode_batch`); templating and the
safety screen are Python, which the interpreter interleaves with the event loop every switch interval.
The pool takes at most `max_pending` jobs at once (running or queued): beyond that a request gets a
503 with Retry-After rather than a place in an unbounded queue."""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from llmserve.server import errors

P = ParamSpec("P")
T = TypeVar("T")

DEFAULT_WORKERS = min(4, os.cpu_count() or 1)
DEFAULT_MAX_PENDING = 256


class WorkerPool:
    def __init__(self, workers: int = DEFAULT_WORKERS, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        self.workers = workers
        self.max_pending = max_pending
        self._slots = threading.BoundedSemaphore(max_pending)
        self._executor: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` on a worker thread; its exceptions are raised here. A cancelled caller
        leaves a job that has started to finish on its own (its slot is freed when it does)."""
        if not self._slots.acquire(blocking=False):
            raise errors.overloaded("Too many requests are being prepared (tokenized); retry later.")
        try:
            future = self._pool().submit(functools.partial(fn, *args, **kwargs))
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(self._release)
        return await asyncio.wrap_future(future)

    def _release(self, _: Future) -> None:
        self._slots.release()

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="llmserve-prepare")
        return self._executor

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
