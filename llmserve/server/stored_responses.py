"""GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items and POST /v1/responses/{id}/cancel: the
Responses API's stored responses, each visible to the key that made it alone (any other key gets a 404, as for an
unknown id). A background response is polled with GET (`queued`, `in_progress`, then as it ended), or, made with
`stream: true`, its events followed again (`?stream=true&starting_after=N`: OpenAI's resume of a dropped stream),
and cancelled while it has not ended. Torch-free: `llmserve serve` and `llmserve gateway` both serve these routes
with their platform's store."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from llmserve.platform.paging import MAX_PAGE_SIZE
from llmserve.platform.responses import UNFINISHED, ResponseNotFound
from llmserve.server.errors import APIError
from llmserve.server.gateway import platform_of, request_key
from llmserve.server.openapi import documented
from llmserve.server.protocol import list_page
from llmserve.server.responses_api import Storage, stop_background
from llmserve.server.responses_protocol import ResponseObject
from llmserve.server.streaming import (
    STREAM_ID_HEADER,
    EventsDropped,
    FollowedStream,
    dropped_events,
    event_stream,
)

router = APIRouter()


def storage_for(request: Request) -> Storage | None:
    """Where this request's responses (and the conversations it continues) are kept: its platform's stores
    under its key; None without them."""
    platform = platform_of(request)
    if platform is None or platform.responses is None:
        return None
    key = request_key(request.state)
    return Storage(platform.responses, key.id if key is not None else None, running=platform.background,
                   conversations=platform.conversations, streams=getattr(request.app.state, "streams", None))


def _storage(request: Request) -> Storage:
    storage = storage_for(request)
    if storage is None:
        raise APIError(404, "Response storage is not enabled on this server.", code="not_enabled")
    return storage


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", code="response_not_found")


async def _call(response_id: str, method: Any, *args: Any) -> Any:
    try:
        return await asyncio.to_thread(method, *args)
    except ResponseNotFound:
        raise _not_found(response_id) from None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"]
    deleted: bool


class InputItemPage(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


@router.get("/v1/responses/{response_id}", responses=documented(ResponseObject, stream=True))
async def get_response(
    response_id: str,
    request: Request,
    stream: bool = False,
    starting_after: int | None = Query(None, ge=-1),
) -> Response:
    """The stored response; with `stream=true`, a streamed background response's events after the one numbered
    `starting_after` (every one without it), then the live rest, from its buffer in this process while it runs
    and for a while after its end."""
    storage = _storage(request)
    stored = await _call(response_id, storage.store.get, storage.key_id, response_id)
    if not stream:
        if starting_after is not None:
            raise APIError(400, "starting_after needs stream=true.", param="starting_after")
        return JSONResponse(stored)
    buffered = await _buffered(storage, response_id)
    if buffered is None:
        raise APIError(400, f"Response '{response_id}' has no events to stream here: only a background response "
                            "created with stream=true can be streamed, by the process that runs it (or, with "
                            "--redis-url, one sharing its Redis), until a while after its end. GET it without "
                            "stream.", param="stream")
    try:
        buffered.check_resumable_after(-1 if starting_after is None else starting_after)
    except EventsDropped:
        raise dropped_events(response_id) from None
    return event_stream(buffered.follow(-1 if starting_after is None else starting_after),
                        {STREAM_ID_HEADER: response_id})


async def _buffered(storage: Storage, response_id: str) -> FollowedStream | None:
    """The buffer of the streamed background response `response_id`, where this process can follow it."""
    if storage.streams is None:
        return None
    try:
        return await storage.streams.get(response_id, storage.key_id)
    except APIError as exc:
        if exc.status == 404:  # not buffered
            return None
        raise


@router.post("/v1/responses/{response_id}/cancel", responses=documented(ResponseObject))
async def cancel_response(response_id: str, request: Request) -> JSONResponse:
    """Cancel a background response that has not ended: it is stored `cancelled`, then its run is stopped (its
    engine request aborted) if this process runs it, or, with streams shared through Redis, the process running
    it is asked to stop it (without Redis it runs to its end there, and does not overwrite that). One that has
    ended is answered as it is; one not made in background is a 400."""
    storage = _storage(request)
    stored = await _call(response_id, storage.store.get, storage.key_id, response_id)
    if not stored.get("background"):
        raise APIError(400, "Only responses created with background can be cancelled.")
    if stored["status"] in UNFINISHED:
        cancelled = {**stored, "status": "cancelled"}
        if await asyncio.to_thread(storage.store.replace_unfinished, storage.key_id, cancelled):
            await stop_background(storage, response_id)
            return JSONResponse(cancelled)
        stored = await _call(response_id, storage.store.get, storage.key_id, response_id)  # it ended meanwhile
    return JSONResponse(stored)


@router.delete("/v1/responses/{response_id}", responses=documented(ResponseDeleted))
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    """Delete a stored response. Responses that continued it keep their own turns, but can no longer be
    continued: their conversation would miss this one's. A background response still running here is stopped:
    what it would end as has nowhere to be kept."""
    storage = _storage(request)
    await _call(response_id, storage.store.delete, storage.key_id, response_id)
    await stop_background(storage, response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items", responses=documented(InputItemPage))
async def list_input_items(
    response_id: str,
    request: Request,
    limit: int = Query(20, ge=1, le=MAX_PAGE_SIZE),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> JSONResponse:
    """A page of the input items the response's request sent (not its previous responses'), newest first
    unless `order=asc`; `after` takes an item id from a previous page."""
    storage = _storage(request)
    items, has_more = await _call(response_id, storage.store.input_items, storage.key_id, response_id, limit, after,
                                  order)
    return JSONResponse(list_page(items, has_more))
