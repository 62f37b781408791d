"""Resumable streams through the gateway (`stream_options.resumable`, server/streams.py): the gateway
holds the buffer itself. A resumable stream's relayed events (screened, metered, numbered and with the
gateway's response id) are produced into the gateway's `StreamRegistry` by a task of their own, so the
relay goes on reading the replica when the client drops, and the request is metered at its real end,
as `llmserve serve` meters it; the client resumes with `GET /v1/streams/{id}` and `Last-Event-ID` from
the same gateway (server/streams.py's routes, over the gateway's registry). The replica streams it plainly:
a stream nobody follows for the grace period is cancelled here, which closes the replica's response and
so aborts the generation there.

Several gateways side by side each hold their own streams; given `--redis-url`, each copies them into Redis, and
a resume or a stop reaching another gateway is served from there (server/shared_streams.py). Without it, a resume
must reach the gateway that relays the stream (a load balancer's affinity by the `x-stream-id`, or by client)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

from fastapi.responses import StreamingResponse

from llmserve.gateway.relay import EVENT_END
from llmserve.server.streaming import STREAM_ID_HEADER, StreamRegistry, event_stream


def resumable_response(
    streams: StreamRegistry, stream_id: str, owner: str | None, relayed: StreamingResponse,
    headers: Mapping[str, str],
) -> StreamingResponse:
    """Produce the relayed stream's events into a resumable stream `stream_id` (that key `owner` may
    follow) and answer with its events as they come."""
    stream = streams.open(stream_id, owner, _one_by_one(relayed.body_iterator))
    return event_stream(stream.follow(), {**headers, STREAM_ID_HEADER: stream_id})


async def _one_by_one(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The relay's chunks (whole events, maybe several) as single events: the buffer counts one each."""
    async for chunk in chunks:
        for event in chunk.split(EVENT_END):
            if event:
                yield event.decode() + "\n\n"
