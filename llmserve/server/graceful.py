"""The HTTP server loop both `llmserve serve` and `llmserve gateway` run: uvicorn, draining on SIGINT or
SIGTERM and returning normally. Imports nothing heavy, so the gateway process stays free of torch."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
ABORT_GRACE_S = 5.0  # after the shutdown timeout: time for the aborted streams to send their error event


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that drains on SIGINT/SIGTERM and then returns normally (exit status 0)
    instead of re-raising the signal, and reports its address once it listens.

    With `on_deadline`, requests still running `shutdown_timeout` seconds into the shutdown are
    ended by it (uvicorn itself cancels them `ABORT_GRACE_S` later, mid-response).

    With `drain_listening`, the server goes on listening after the signal until no request is left
    running (or `shutdown_timeout` passed): the app answers new requests (its /health included) with a
    503 saying it is draining, so a gateway or a load balancer sees the drain as such, instead of a
    refused connection that looks like a crash, while in-flight requests finish. Only then does uvicorn
    stop listening and shut down."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_signal: Callable[[], None],
        on_listening: Callable[[str, int], None],
        on_deadline: Callable[[], None] | None = None,
        shutdown_timeout: float | None = None,
        drain_listening: bool = False,
    ) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        self._on_listening = on_listening
        self._on_deadline = on_deadline
        self._shutdown_timeout = shutdown_timeout
        self._drain_listening = drain_listening
        self._signalled_at: float | None = None

    @property
    def _draining_for(self) -> float:
        return 0.0 if self._signalled_at is None else time.monotonic() - self._signalled_at

    async def on_tick(self, counter: int) -> bool:
        if self._signalled_at is not None and not self.should_exit and self._drained():
            self.should_exit = True
        return await super().on_tick(counter)

    def _drained(self) -> bool:
        """No request is running any more (a 503 to a late request is one for a moment), or time is up."""
        timeout = self._shutdown_timeout if self._shutdown_timeout is not None else 0.0
        return not self.server_state.tasks or self._draining_for >= timeout

    async def shutdown(self, sockets: list | None = None) -> None:
        if self._on_deadline is None or self._shutdown_timeout is None:
            await super().shutdown(sockets)
            return
        remaining = max(0.0, self._shutdown_timeout - self._draining_for)  # counted from the signal
        deadline = asyncio.get_running_loop().call_later(remaining, self._on_deadline)
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
        if self._signalled_at is not None or self.should_exit:
            if sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl+C: stop waiting for in-flight requests
            self.should_exit = True
            return
        self._signalled_at = time.monotonic()
        if not self._drain_listening:
            self.should_exit = True  # else on_tick stops the server once drained
        self._on_signal()

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        servers = getattr(self, "servers", [])
        if self.started and servers and servers[0].sockets:
            host, port = servers[0].sockets[0].getsockname()[:2]
            self._on_listening(host, port)
