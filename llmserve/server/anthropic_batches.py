"""Anthropic's Message Batches API (/v1/messages/batches: create, retrieve, list, cancel, delete, results), as a view
of the Batch API's batches (server/batches.py): a message batch is a batch of `/v1/messages` requests whose input file
this module writes, run by the same batch runner, so each request is keyed, limited, screened and metered as any.
Each belongs to the key that made it. Torch-free: `llmserve serve` and `llmserve gateway` both serve these routes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from datetime import datetime, timezone
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from llmserve.platform.batches import DEFAULT_EXPIRES_AFTER, MAX_REQUESTS, BatchNotEnded, FileNotFound
from llmserve.server.batches import batch_runner_of, batch_store, store_call
from llmserve.server.errors import APIError
from llmserve.server.openapi import documented

router = APIRouter()

ENDPOINT = "/v1/messages"
ID_PREFIX = "msgbatch_"
REQUESTS_KEY = "anthropic_message_batch_requests"  # the batch's metadata: how many requests it was made with
_CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_ENDED = ("completed", "failed", "expired", "cancelled")
_UNRUN = {"batch_cancelled": "canceled", "batch_expired": "expired"}  # the runner's codes for requests never run


class MessageBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    custom_id: str
    params: dict[str, Any]


class CreateMessageBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    requests: list[MessageBatchRequest] = Field(min_length=1, max_length=MAX_REQUESTS)


class RequestCounts(BaseModel):
    processing: int
    succeeded: int
    errored: int
    canceled: int
    expired: int


class MessageBatch(BaseModel):
    id: str
    type: Literal["message_batch"]
    processing_status: Literal["in_progress", "canceling", "ended"]
    request_counts: RequestCounts
    created_at: str
    expires_at: str
    ended_at: str | None
    cancel_initiated_at: str | None
    archived_at: str | None
    results_url: str | None


class MessageBatchPage(BaseModel):
    data: list[MessageBatch]
    has_more: bool
    first_id: str | None
    last_id: str | None


class MessageBatchDeleted(BaseModel):
    id: str
    type: Literal["message_batch_deleted"]


@router.post("/v1/messages/batches", responses=documented(MessageBatch))
async def create_message_batch(body: CreateMessageBatch, request: Request) -> JSONResponse:
    """A batch of Messages API requests, each `params` as `/v1/messages` takes it (not streamed), its `custom_id`
    unique in the batch; its results can be read once it has ended (within 24 hours)."""
    store, key_id = batch_store(request)
    content = await asyncio.to_thread(_input_file, body.requests)  # (grows with the batch: off the event loop)
    source = await store_call(store.files.create, key_id, "message_batch.jsonl", "batch", content, DEFAULT_EXPIRES_AFTER)
    batch = await store_call(store.create, key_id, source["id"], ENDPOINT, "24h", {REQUESTS_KEY: str(len(body.requests))})
    runner = batch_runner_of(request)
    if runner is not None:
        runner.wake()
    return JSONResponse(await _message_batch(request, batch))


@router.get("/v1/messages/batches", responses=documented(MessageBatchPage))
async def list_message_batches(
    request: Request, limit: int = Query(20, ge=1, le=100), after_id: str | None = None,
    before_id: str | None = None,
) -> JSONResponse:
    """The key's message batches, newest first: the next older than `after_id` (the last id of the page before), or
    the next newer than `before_id` (the first id of the page after)."""
    if after_id is not None and before_id is not None:
        raise APIError(400, "Give after_id or before_id, not both.", param="before_id")
    store, key_id = batch_store(request)
    after = _batch_id(after_id) if after_id is not None else None
    before = _batch_id(before_id) if before_id is not None else None
    batches, has_more = await store_call(store.list, key_id, limit, after, ENDPOINT, before)
    data = [await _message_batch(request, batch) for batch in batches]
    return JSONResponse({"data": data, "has_more": has_more, "first_id": data[0]["id"] if data else None,
                         "last_id": data[-1]["id"] if data else None})


@router.get("/v1/messages/batches/{message_batch_id}", responses=documented(MessageBatch))
async def get_message_batch(message_batch_id: str, request: Request) -> JSONResponse:
    store, key_id = batch_store(request)
    return JSONResponse(await _message_batch(request, await store_call(store.get, key_id, _batch_id(message_batch_id))))


@router.post("/v1/messages/batches/{message_batch_id}/cancel", responses=documented(MessageBatch))
async def cancel_message_batch(message_batch_id: str, request: Request) -> JSONResponse:
    """Stop a batch: "canceling" until the requests running are stopped, then "ended" (those never run are
    `canceled` in its results); a 409 once it has ended."""
    store, key_id = batch_store(request)
    batch_id = _batch_id(message_batch_id)
    batch = await store_call(store.cancel, key_id, batch_id)
    runner = batch_runner_of(request)
    if runner is not None:
        runner.cancelled(batch_id)
    return JSONResponse(await _message_batch(request, batch))


@router.delete("/v1/messages/batches/{message_batch_id}", responses=documented(MessageBatchDeleted))
async def delete_message_batch(message_batch_id: str, request: Request) -> JSONResponse:
    """Forget an ended batch and its results (a 409 before it ended: cancel it first)."""
    store, key_id = batch_store(request)
    batch_id = _batch_id(message_batch_id)
    batch = await store_call(store.get, key_id, batch_id)
    try:
        await store_call(store.delete, key_id, batch_id)
    except BatchNotEnded as exc:
        raise APIError(409, str(exc), code="batch_not_ended") from None
    if REQUESTS_KEY in (batch["metadata"] or {}):  # its input file was this API's: it goes too (if not gone yet)
        with contextlib.suppress(FileNotFound):
            await asyncio.to_thread(store.files.delete, key_id, batch["input_file_id"])
    return JSONResponse({"id": message_batch_id, "type": "message_batch_deleted"})


@router.get("/v1/messages/batches/{message_batch_id}/results", response_class=Response,
            responses={200: {"description": "One result a line (JSON Lines)",
                             "content": {"application/x-jsonl": {"schema": {"type": "string"}}}}})
async def message_batch_results(message_batch_id: str, request: Request) -> Response:
    """Each request's result once the batch has ended (those that succeeded first, then the others; match them by
    `custom_id`): `succeeded` (the message), `errored` (the error it was answered with), `canceled` or `expired`
    (it never ran)."""
    store, key_id = batch_store(request)
    batch = await store_call(store.get, key_id, _batch_id(message_batch_id))
    if batch["status"] not in _ENDED:
        raise APIError(400, f"Message batch {message_batch_id} has not ended: its results are not ready.",
                       code="batch_not_ended")
    contents = [await store_call(store.files.content, key_id, file_id)
                for file_id in (batch["output_file_id"], batch["error_file_id"]) if file_id is not None]
    return Response(await asyncio.to_thread(_results, contents), media_type="application/x-jsonl")


def _input_file(requests: list[MessageBatchRequest]) -> bytes:
    """The Batch API's input file of the requests, checked."""
    _check_requests(requests)
    lines = (json.dumps({"custom_id": item.custom_id, "method": "POST", "url": ENDPOINT, "body": item.params})
             for item in requests)
    return ("\n".join(lines) + "\n").encode()


def _check_requests(requests: list[MessageBatchRequest]) -> None:
    seen: set[str] = set()
    for i, item in enumerate(requests):
        if not _CUSTOM_ID.match(item.custom_id):
            raise APIError(400, "custom_id must be 1 to 64 letters, digits, '_' or '-'.",
                           param=f"requests[{i}].custom_id")
        if item.custom_id in seen:
            raise APIError(400, f"custom_id {item.custom_id!r} is not unique in the batch.",
                           param=f"requests[{i}].custom_id")
        if item.params.get("stream"):
            raise APIError(400, "A batch's requests are not streamed.", param=f"requests[{i}].params.stream")
        seen.add(item.custom_id)


def _batch_id(message_batch_id: str) -> str:
    """The Batch API's id of a message batch (one that is not a message batch's: a 404, as for an unknown id)."""
    if not message_batch_id.startswith(ID_PREFIX):
        raise APIError(404, f"Message batch {message_batch_id!r} not found.", code="not_found_error")
    return "batch_" + message_batch_id.removeprefix(ID_PREFIX)


async def _message_batch(request: Request, batch: dict[str, Any]) -> dict[str, Any]:
    """A Batch API batch as Anthropic's message batch."""
    message_batch_id = ID_PREFIX + batch["id"].removeprefix("batch_")
    status = batch["status"]
    ended = status in _ENDED
    counts = batch["request_counts"]
    unrun = await _unrun_counts(request, batch) if status in ("cancelled", "expired") else {}
    made_with = int((batch["metadata"] or {}).get(REQUESTS_KEY, counts["total"]))
    total = counts["total"] or made_with
    errored = counts["failed"] - sum(unrun.values())
    return {
        "id": message_batch_id, "type": "message_batch",
        "processing_status": "ended" if ended else "canceling" if status == "cancelling" else "in_progress",
        "request_counts": {
            "processing": 0 if ended else total - counts["completed"] - counts["failed"],
            "succeeded": counts["completed"], "errored": errored,
            "canceled": unrun.get("canceled", 0), "expired": unrun.get("expired", 0),
        },
        "created_at": _rfc3339(batch["created_at"]),
        "expires_at": _rfc3339(batch["expires_at"]),
        "ended_at": _rfc3339(next((batch[f"{s}_at"] for s in _ENDED if batch.get(f"{s}_at")), None)),
        "cancel_initiated_at": _rfc3339(batch["cancelling_at"]),
        "archived_at": None,
        "results_url": str(request.url_for("message_batch_results", message_batch_id=message_batch_id))
        if ended else None,
    }


async def _unrun_counts(request: Request, batch: dict[str, Any]) -> dict[str, int]:
    """How many of an ended batch's requests never ran, by why (canceled, expired)."""
    store, key_id = batch_store(request)
    if batch["error_file_id"] is None:
        return {}
    content = await store_call(store.files.content, key_id, batch["error_file_id"])
    return await asyncio.to_thread(_count_unrun, content)


def _count_unrun(error_file: bytes) -> dict[str, int]:
    counts: dict[str, int] = {}
    for record in _records(error_file):
        why = _UNRUN.get((record.get("error") or {}).get("code"))
        if why is not None:
            counts[why] = counts.get(why, 0) + 1
    return counts


def _results(contents: list[bytes]) -> str:
    """The output and error files' lines as Anthropic's results, JSON Lines."""
    return "".join(json.dumps({"custom_id": record["custom_id"], "result": _result(record)}) + "\n"
                   for content in contents for record in _records(content))


def _result(record: dict[str, Any]) -> dict[str, Any]:
    """A Batch API output or error line as Anthropic's result."""
    error = record.get("error")
    if error is not None:
        return {"type": _UNRUN.get(error.get("code"), "errored"),
                **({} if error.get("code") in _UNRUN else {"error": _anthropic_error(error)})}
    response = record["response"]
    if response["status_code"] == 200:
        return {"type": "succeeded", "message": response["body"]}
    return {"type": "errored", "error": _anthropic_error((response["body"] or {}).get("error") or {})}


def _anthropic_error(error: dict[str, Any]) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error.get("type") or "api_error",
                                       "message": error.get("message") or "The request failed."}}


def _records(content: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in content.decode().splitlines() if line.strip()]


def _rfc3339(unix: int | None) -> str | None:
    return datetime.fromtimestamp(unix, timezone.utc).isoformat().replace("+00:00", "Z") if unix is not None else None
