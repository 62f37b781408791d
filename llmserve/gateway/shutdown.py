"""The end of the streams a gateway relays when its shutdown runs out of time (`--shutdown-timeout`),
as `llmserve serve` ends its own: each stream still open gets an error event (`shutting_down`) and
`data: [DONE]`, and is metered as aborted by the server (the platform's `aborting`); closing its
replica's response aborts the generation there.

Each relayed stream waits for its next events inside a timeout scope with no deadline; the cut-off
moves every such deadline to now, which cancels the waits at once, without a task per stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from llmserve.gateway.proxy import StreamFilter
from llmserve.gateway.relay import EVENT_END
from llmserve.server.errors import shutting_down
from llmserve.server.streaming import sse

SSE_DONE = "data: [DONE]\n\n"


class StreamCutoff:
    def __init__(self) -> None:
        self._waits: set[asyncio.Timeout] = set()
        self.cut = False

    def cut_all(self) -> None:
        """End every relayed stream now (and any that would start after)."""
        self.cut = True
        now = asyncio.get_running_loop().time()
        for wait in list(self._waits):
            wait.reschedule(now)

    async def guard(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """`events` (whole SSE events, numbered from 0 with `id:` lines) until the cut-off, then the
        error event (numbered next) and the end."""
        sent = 0
        while True:
            try:
                async with asyncio.timeout(None) as wait:
                    self._waits.add(wait)
                    if self.cut:
                        wait.reschedule(asyncio.get_running_loop().time())
                    try:
                        chunk = await anext(events)
                    finally:
                        self._waits.discard(wait)
            except StopAsyncIteration:
                return
            except TimeoutError:
                if not wait.expired():
                    raise
                # the cancelled wait closed `events` on its way out (its relay metered it, its replica response closed)
                yield f"id: {sent}\n{sse(shutting_down().body_json())}id: {sent + 1}\n{SSE_DONE}".encode()
                return
            sent += chunk.count(EVENT_END)
            yield chunk


class GuardedStream:
    """A relayed stream's filter (a `proxy.StreamFilter`) whose events end at the cut-off."""

    def __init__(self, inner: StreamFilter, cutoff: StreamCutoff) -> None:
        self.inner = inner
        self.cutoff = cutoff

    def events(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        return self.cutoff.guard(self.inner.events(events))

    def ended(self) -> None:
        self.inner.ended()
