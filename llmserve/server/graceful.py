"""The HTTP server loop both `llmserve serve` and `llmserve gateway` run: uvicorn, draining on SIGINT or
SIGTERM and returning normally. Imports nothing heavy, so the gateway process stays free of torch."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that drains on SIGINT/SIGTERM and then returns normally (exit status 0)
    instead of re-raising the signal, and reports its address once it listens.

    With `on_deadline`, requests still running `shutdown_timeout` seconds into the shutdown are
    ended by it (uvicorn itself cancels them `ABORT_GRACE_S` later, mid-response)."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_signal: Callable[[], None],
        on_listening: Callable[[str, int], None],
        on_deadline: Callable[[], None] | None = None,
        shutdown_timeout: float | None = None,
    ) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        self._on_listening = on_listening
        self._on_deadline = on_deadline
        self._shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets: list | None = None) -> None:
        if self._on_deadline is None or self._shutdown_timeout is None:
            await super().shutdown(sockets)
            return
        deadline = asyncio.get_running_loop().call_later(self._shutdown_timeout, self._on_deadline)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._handle_signal) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _handle_signal(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl+C: stop waiting for in-flight requests
        self.should_exit = True
        self._on_signal()

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        servers = getattr(self, "servers", [])
        if self.started and servers and servers[0].sockets:
            host, port = servers[0].sockets[0].getsockname()[:2]
            self._on_listening(host, port)
