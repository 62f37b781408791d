"""OpenAI's Files and Batch APIs: /v1/files (a batch's input, uploaded; its output and errors, read back) and
/v1/batches (create, retrieve, list, cancel). Each file and batch belongs to the key that made it; any other key
gets a 404, as for an unknown id. The batches are run by the server's `BatchRunner` (batch_runner.py). Torch-free:
`llmserve serve` and `llmserve gateway` both serve these routes with their platform's store."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from llmserve.platform.batches import (
    DEFAULT_EXPIRES_AFTER,
    MAX_PAGE_SIZE,
    BatchNotCancellable,
    BatchNotFound,
    BatchStore,
    FileInUse,
    FileNotFound,
)
from llmserve.server.errors import APIError
from llmserve.server.gateway import BatchSignals, platform_of, request_key
from llmserve.server.openapi import documented
from llmserve.server.protocol import list_page

router = APIRouter()
T = TypeVar("T")


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    expires_at: int | None
    filename: str
    purpose: str
    status: str
    status_details: str | None


class FilePage(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchErrors(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    usage: dict[str, Any] | None
    metadata: dict[str, str] | None


class BatchPage(BaseModel):
    object: Literal["list"]
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ExpiresAfter(BaseModel):
    """OpenAI's expiration policy of a file: kept `seconds` after it was made (its only anchor)."""

    model_config = ConfigDict(extra="forbid")
    anchor: Literal["created_at"]
    seconds: int


class CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str = Field(max_length=64)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None  # its output and error files' (30 days without)


def batch_store(request: Request) -> tuple[BatchStore, str | None]:
    platform = platform_of(request)
    if platform is None or platform.batches is None:
        raise APIError(404, "The Batch API is not enabled on this server.", code="not_enabled")
    key = request_key(request.state)
    return platform.batches, key.id if key is not None else None


def batch_runner_of(request: Request) -> BatchSignals | None:
    """The batch runner of this server (None before its start, or after its stop)."""
    platform = platform_of(request)
    return platform.batch_runner if platform is not None else None


async def store_call(method: Callable[..., T], *args: Any) -> T:
    """A store call on a worker thread, its refusals as OpenAI answers them."""
    try:
        return await asyncio.to_thread(method, *args)
    except FileNotFound as exc:
        raise APIError(404, str(exc), code="file_not_found") from None
    except BatchNotFound as exc:
        raise APIError(404, str(exc), code="batch_not_found") from None
    except FileInUse as exc:
        raise APIError(409, str(exc), code="file_in_use") from None
    except BatchNotCancellable as exc:
        raise APIError(409, str(exc), code="batch_not_cancellable") from None


# ---- files ---------------------------------------------------------------------------------------------


@router.post("/v1/files", responses=documented(FileObject))
async def upload_file(
    request: Request, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()],
    expires_anchor: Annotated[str | None, Form(alias="expires_after[anchor]")] = None,
    expires_seconds: Annotated[int | None, Form(alias="expires_after[seconds]")] = None,
) -> JSONResponse:
    """Upload a batch's input (`purpose` "batch"): JSON Lines, one request a line, as OpenAI's. It is kept for 30
    days, or `expires_after[seconds]` (an hour to 30 days) after it was made (`expires_after[anchor]`
    "created_at"); then it is gone, as if deleted, but for the batches already made from it."""
    store, key_id = batch_store(request)
    if (expires_anchor is None) != (expires_seconds is None):
        raise APIError(400, "expires_after needs both its anchor and its seconds.", param="expires_after")
    if expires_anchor not in (None, "created_at"):
        raise APIError(400, f"expires_after[anchor] must be 'created_at', got {expires_anchor!r}.",
                       param="expires_after.anchor")
    content = await file.read()
    return JSONResponse(await store_call(store.files.create, key_id, file.filename or "upload", purpose, content,
                                    DEFAULT_EXPIRES_AFTER if expires_seconds is None else expires_seconds))


@router.get("/v1/files", responses=documented(FilePage))
async def list_files(
    request: Request,
    purpose: str | None = None,
    limit: int = Query(MAX_PAGE_SIZE, ge=1, le=MAX_PAGE_SIZE),
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> JSONResponse:
    """The key's files, newest first unless `order=asc`: uploaded ones ("batch") and batches' output
    ("batch_output")."""
    store, key_id = batch_store(request)
    files, has_more = await store_call(store.files.list, key_id, purpose, limit, after, order)
    return JSONResponse(list_page(files, has_more))


@router.get("/v1/files/{file_id}", responses=documented(FileObject))
async def get_file(file_id: str, request: Request) -> JSONResponse:
    store, key_id = batch_store(request)
    return JSONResponse(await store_call(store.files.get, key_id, file_id))


@router.get("/v1/files/{file_id}/content", response_class=Response,
            responses={200: {"description": "The file's bytes",
                             "content": {"application/octet-stream": {"schema": {"type": "string"}}}}})
async def file_content(file_id: str, request: Request) -> Response:
    store, key_id = batch_store(request)
    return Response(await store_call(store.files.content, key_id, file_id), media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}", responses=documented(FileDeleted))
async def delete_file(file_id: str, request: Request) -> JSONResponse:
    """Delete a file; 409 while an unfinished batch reads its requests from it."""
    store, key_id = batch_store(request)
    await store_call(store.files.delete, key_id, file_id)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


# ---- batches -------------------------------------------------------------------------------------------


@router.post("/v1/batches", responses=documented(BatchObject))
async def create_batch(body: CreateBatch, request: Request) -> JSONResponse:
    """A batch of the requests in `input_file_id`, all to `endpoint` (one of /v1/chat/completions,
    /v1/completions, /v1/embeddings, /v1/responses, /v1/moderations, /v1/messages), to end within
    `completion_window` ("24h").
    It is "validating" until this server's batch runner reads the file. Its output and error files are kept for
    30 days, or `output_expires_after`."""
    store, key_id = batch_store(request)
    keep = body.output_expires_after
    batch = await store_call(store.create, key_id, body.input_file_id, body.endpoint, body.completion_window,
                        body.metadata, DEFAULT_EXPIRES_AFTER if keep is None else keep.seconds)
    runner = batch_runner_of(request)
    if runner is not None:
        runner.wake()
    return JSONResponse(batch)


@router.get("/v1/batches", responses=documented(BatchPage))
async def list_batches(request: Request, limit: int = Query(20, ge=1, le=100), after: str | None = None) -> JSONResponse:
    store, key_id = batch_store(request)
    batches, has_more = await store_call(store.list, key_id, limit, after)
    return JSONResponse(list_page(batches, has_more))


@router.get("/v1/batches/{batch_id}", responses=documented(BatchObject))
async def get_batch(batch_id: str, request: Request) -> JSONResponse:
    store, key_id = batch_store(request)
    return JSONResponse(await store_call(store.get, key_id, batch_id))


@router.post("/v1/batches/{batch_id}/cancel", responses=documented(BatchObject))
async def cancel_batch(batch_id: str, request: Request) -> JSONResponse:
    """Stop a batch: "cancelling" until the requests running are stopped and the output so far is written
    (within seconds), then "cancelled"; 409 once it has ended."""
    store, key_id = batch_store(request)
    batch = await store_call(store.cancel, key_id, batch_id)
    runner = batch_runner_of(request)
    if runner is not None:
        runner.cancelled(batch_id)
    return JSONResponse(batch)
