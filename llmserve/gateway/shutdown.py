"""The end of the streams a gateway relays when its shutdown runs out of time (`--shutdown-timeout`),
as `llmserve serve` ends its own: each stream still open gets an error event (`shutting_down`) and
`data: [DONE]`, and is metered as aborted by the server (the platform's `aborting`); closing its
replica's response aborts the generation there.

A stream waiting for its replica's next events is woken by cancelling its task while (and only
while) it waits in `guard`, so the cancellation lands in the replica read, never in a send to the
client; per event that costs a set insertion, not a timer."""

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
        self._waiting: set[asyncio.Task] = set()  # the streams' tasks waiting for their next events
        self.cut = False

    def cut_all(self) -> None:
        """End every relayed stream now (and any that would start after)."""
        self.cut = True
        for task in self._waiting:
            task.cancel()

    async def guard(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """`events` (whole SSE events, numbered from 0 with `id:` lines) until the cut-off, then the
        error event (numbered next) and the end."""
        task = asyncio.current_task()
        assert task is not None
        sent = 0
        while not self.cut:
            self._waiting.add(task)
            try:
                chunk = await anext(events)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if not self.cut:
                    raise
                task.uncancel()  # ours: `events` is closed already (its relay metered it on its way out)
                break
            finally:
                self._waiting.discard(task)
            sent += chunk.count(EVENT_END)
            yield chunk
        await events.aclose()  # type: ignore[attr-defined]
        yield f"id: {sent}\n{sse(shutting_down().body_json())}id: {sent + 1}\n{SSE_DONE}".encode()


class GuardedStream:
    """A relayed stream's filter (a `proxy.StreamFilter`) whose events end at the cut-off."""

    def __init__(self, inner: StreamFilter, cutoff: StreamCutoff) -> None:
        self.inner = inner
        self.cutoff = cutoff

    def events(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        return self.cutoff.guard(self.inner.events(events))

    def ended(self) -> None:
        self.inner.ended()
