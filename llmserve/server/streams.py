"""Resumable streams: a streamed chat or text completion asked for with `stream_options: {"resumable":
true}` keeps generating into a bounded buffer when its client drops, and the client (same key) picks it
up again with `GET /v1/streams/{id}` and `Last-Event-ID`, getting the events it missed and then the
live rest; `DELETE /v1/streams/{id}` stops it (the stop button of a client that may reconnect).

Every streamed event carries an `id:` (its number in the response, from 0); the stream's id is the
response id, also in the `x-stream-id` header. Bounds: a stream's buffer keeps at most `max_chars` of
its newest events (a resume from an event already dropped gets a 410); a stream nobody follows for
`grace_seconds` is aborted (its KV freed), and a finished one is forgotten `grace_seconds` after its
end. A stream without the option is not kept: a disconnect aborts it at once. With `--redis-url`, processes
sharing that Redis resume and stop each other's streams (server/shared_streams.py).
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from llmserve.server.errors import APIError
from llmserve.server.gateway import request_key
from llmserve.server.openapi import documented
from llmserve.server.streaming import (
    STREAM_ID_HEADER,
    EventsDropped,
    StreamRegistry,
    dropped_events,
    event_stream,
)

router = APIRouter()


def registry_of(request: Request) -> StreamRegistry:
    """The app's resumable streams (`llmserve serve`'s, or a gateway's: it buffers what it relays)."""
    return request.app.state.streams


def _last_event(header: str | None) -> int:
    """The id of the last event the client has (-1, or no header: none, replay from the start)."""
    if not header:
        return -1
    try:
        number = int(header)
    except ValueError:
        number = None
    if number is None or number < -1:
        raise APIError(400, "Last-Event-ID must be an event id of the stream (an integer).", param="Last-Event-ID")
    return number


class StreamDeleted(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    object: Literal["stream.deleted"]
    deleted: bool


@router.get(
    "/v1/streams/{stream_id}", response_model=None,
    responses={200: {"description": "The stream's events after `Last-Event-ID`, then the live rest.",
                     "content": {"text/event-stream": {}}},
               404: {"description": "Unknown, forgotten, or another key's stream."},
               410: {"description": "The events after `Last-Event-ID` are no longer buffered."}},
)
async def resume_stream(
    stream_id: str, request: Request, last_event_id: str | None = Header(None, alias="Last-Event-ID")
) -> Response:
    """Resume a stream started with `stream_options.resumable`: the events after `Last-Event-ID` (all
    of them without it), then the live rest."""
    streams = registry_of(request)
    key = request_key(request.state)
    stream = await streams.get(stream_id, key.id if key is not None else None)
    last_event = _last_event(last_event_id)
    try:
        stream.check_resumable_after(last_event)
    except EventsDropped:
        raise dropped_events(stream_id) from None
    return event_stream(stream.follow(last_event), {STREAM_ID_HEADER: stream_id})


@router.delete("/v1/streams/{stream_id}", responses=documented(StreamDeleted))
async def cancel_stream(stream_id: str, request: Request) -> JSONResponse:
    """Stop a resumable stream's generation now (its KV is freed) and forget it. A background response's stream
    is not stopped here: the response is cancelled (POST /v1/responses/{id}/cancel), which ends it."""
    key = request_key(request.state)
    stream = await registry_of(request).get(stream_id, key.id if key is not None else None)
    if stream.outlives_followers:
        raise APIError(400, f"Stream '{stream_id}' is a background response's: cancel the response "
                            f"(POST /v1/responses/{stream_id}/cancel) to stop it.")
    await stream.stop()
    return JSONResponse({"id": stream_id, "object": "stream.deleted", "deleted": True})
