"""A non-streamed chat or completion through the gateway's platform: the replica is asked (with
`PROGRESS_HEADER`) to send it as events, the usage so far every few tokens and then the response
(what it would have answered) as the last one, so that a request whose client leaves mid-generation
is metered with the tokens the replica had generated, as `llmserve serve` meters it. Leaving closes
the replica's response, which aborts the generation there. A replica that answers with plain JSON
(one that predates the header) is taken as it is."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.responses import Response, StreamingResponse

from llmserve.gateway.relay import EVENT_END, RelayMeter

REPLICA_FAILED = "replica_failed"  # the code of the error event that ends a stream whose replica broke off


class WholeReply:
    """The replica's events for one non-streamed request (a `proxy.StreamFilter`, passing them on as
    they are: the gateway reads them itself with `read`)."""

    def __init__(self, meter: RelayMeter) -> None:
        self.meter = meter
        self.data: dict[str, Any] | None = None  # the response, or the error event of a broken one

    @property
    def replica_failed(self) -> bool:
        """The replica broke off (the proxy ended its events with its error) before the response."""
        error = (self.data or {}).get("error")
        return isinstance(error, dict) and error.get("code") == REPLICA_FAILED

    def events(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        return events

    def ended(self) -> None:
        pass

    async def read(self, response: StreamingResponse) -> None:
        """Read the events to their end: the usage reports go to the meter, the last data is kept."""
        async for chunk in response.body_iterator:
            for event in bytes(chunk).split(EVENT_END):
                payload = _data_of(event)
                if payload is None or not payload.startswith(b"{"):
                    continue
                data = json.loads(payload)
                if set(data) == {"usage"}:
                    self.meter.observe_usage(data["usage"])
                else:
                    self.data = data


class WholeForwarding:
    """One non-streamed request's way through the replicas: the reply read whole (the usage reports
    metered on the way); a reply whose replica broke off (no byte reached the client yet) is asked
    once more, of another replica (the proxy ejected the broken one). One meter for both tries."""

    def __init__(self, new_meter: Callable[[], RelayMeter]) -> None:
        self._new_meter = new_meter
        self.replies: list[WholeReply] = []  # one per try that a replica answered with events

    @property
    def meter(self) -> RelayMeter | None:
        """The request's meter, once a replica answered with events (None before)."""
        return self.replies[0].meter if self.replies else None

    def reply(self) -> WholeReply:
        """The stream filter of a try (the proxy calls it when a replica's events are handed over)."""
        self.replies.append(WholeReply(self.meter or self._new_meter()))
        return self.replies[-1]

    async def run(self, forward: Callable[[], Awaitable[Response]]) -> Response:
        response = await forward()
        if self.replies:
            await self.replies[-1].read(response)
            if self.replies[-1].replica_failed:
                response = await forward()
                if len(self.replies) == 2:
                    await self.replies[-1].read(response)
        return response


def _data_of(event: bytes) -> bytes | None:
    for line in event.split(b"\n"):
        if line.startswith(b"data: "):
            return line[6:]
    return None
