"""OpenAI's stored chat completions: a chat completion made with `store: true` is kept for its key, with its
`metadata`, where the platform stores them (`llmserve serve`'s and `llmserve gateway`'s, streamed or not, as the
client saw it: its choices after the safety screen, and its usage). Each is visible to the key that made it alone
(another key gets a 404, as for an unknown id):

- GET /v1/chat/completions lists them, oldest first unless `order=desc`, filtered by `model` and by
  `metadata[key]=value` pairs, a page at a time (`after`, `limit`);
- GET /v1/chat/completions/{id} reads one back, with its current metadata;
- GET /v1/chat/completions/{id}/messages lists the messages its request sent;
- POST /v1/chat/completions/{id} replaces its metadata (the one change OpenAI's API allows);
- DELETE /v1/chat/completions/{id} deletes it.

They are purged as stored responses are (`--response-retention-days`). Without storage (`--no-platform`),
`store: true` is a 400 rather than a completion silently not kept. Torch-free: the gateway serves these too.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from llmserve.errors import InvalidRequestError
from llmserve.platform.chat_completions import (
    CompletionNotFound,
    StoredCompletions,
    stored_messages,
)
from llmserve.platform.keys import ApiKey
from llmserve.platform.paging import MAX_PAGE_SIZE
from llmserve.server.errors import APIError
from llmserve.server.gateway import Platform, platform_of, request_key
from llmserve.server.openapi import documented
from llmserve.server.protocol import ChatCompletionRequest, ChatCompletionResponse, Metadata, list_page

router = APIRouter()

_METADATA_PARAM = re.compile(r"metadata\[(.+)\]")


@dataclass(frozen=True)
class CompletionKeeper:
    """Where a `store: true` chat completion goes once answered: the store, the caller's key (None in local mode),
    the messages its request sent and its metadata."""

    store: StoredCompletions
    key_id: str | None
    messages: list[dict[str, Any]]
    metadata: Mapping[str, str]

    async def save(self, completion: dict[str, Any]) -> None:
        """Keep `completion` (a chat.completion as the client got it, or would have got it unstreamed)."""
        messages = stored_messages(completion["id"], self.messages)
        await asyncio.to_thread(self.store.save, self.key_id, completion, messages, self.metadata)


def keeper_for(platform: Platform | None, key: ApiKey | None, body: ChatCompletionRequest) -> CompletionKeeper | None:
    """The keeper of a request that asked to be stored (None for one that did not); a 400 where nothing is stored."""
    if not body.store:
        return None
    if platform is None or platform.completions is None:
        raise InvalidRequestError("store needs stored chat completions, which this server does not keep (it runs "
                                  "without its platform).", param="store")
    messages = [message.model_dump(exclude_none=True) for message in body.messages]
    return CompletionKeeper(platform.completions, key.id if key is not None else None, messages, body.metadata or {})


class StoredChatCompletion(ChatCompletionResponse):
    metadata: dict[str, str]


class StoredChatCompletionPage(BaseModel):
    object: Literal["list"]
    data: list[StoredChatCompletion]
    first_id: str | None
    last_id: str | None
    has_more: bool


class StoredMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # the message's own fields (name, tool_calls, ...) as sent

    id: str
    role: str
    content: str | None
    content_parts: list[dict[str, Any]] | None


class StoredMessagePage(BaseModel):
    object: Literal["list"]
    data: list[StoredMessage]
    first_id: str | None
    last_id: str | None
    has_more: bool


class CompletionDeleted(BaseModel):
    id: str
    object: Literal["chat.completion.deleted"]
    deleted: bool


class MetadataUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    metadata: Metadata | None


def _store(request: Request) -> tuple[StoredCompletions, str | None]:
    platform = platform_of(request)
    if platform is None or platform.completions is None:
        raise APIError(404, "Chat completion storage is not enabled on this server.", code="not_enabled")
    key = request_key(request.state)
    return platform.completions, key.id if key is not None else None


async def _call(completion_id: str, method: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return await asyncio.to_thread(method, *args, **kwargs)
    except CompletionNotFound:
        raise APIError(404, f"Chat completion with id '{completion_id}' not found.",
                       code="chat_completion_not_found") from None


def _metadata_filter(request: Request) -> dict[str, str]:
    """`metadata[key]=value` query parameters (as OpenAI's SDKs send a metadata filter)."""
    pairs = {}
    for name, value in request.query_params.multi_items():
        if match := _METADATA_PARAM.fullmatch(name):
            pairs[match.group(1)] = value
    return pairs


@router.get("/v1/chat/completions", responses=documented(StoredChatCompletionPage))
async def list_chat_completions(
    request: Request,
    model: str | None = None,
    after: str | None = None,
    limit: int = Query(20, ge=1, le=MAX_PAGE_SIZE),
    order: Literal["asc", "desc"] = "asc",
) -> JSONResponse:
    """The key's stored chat completions, oldest first unless `order=desc`; `model` and `metadata[key]=value`
    filter them, `after` takes a completion id from the previous page."""
    store, key_id = _store(request)
    found, has_more = await asyncio.to_thread(store.list, key_id, model, _metadata_filter(request), limit, after,
                                              order)
    return JSONResponse(list_page(found, has_more))


@router.get("/v1/chat/completions/{completion_id}", responses=documented(StoredChatCompletion))
async def get_chat_completion(completion_id: str, request: Request) -> JSONResponse:
    store, key_id = _store(request)
    return JSONResponse(await _call(completion_id, store.get, key_id, completion_id))


@router.post("/v1/chat/completions/{completion_id}", responses=documented(StoredChatCompletion))
async def update_chat_completion(completion_id: str, body: MetadataUpdate, request: Request) -> JSONResponse:
    """Replace a stored completion's metadata (null clears it)."""
    store, key_id = _store(request)
    return JSONResponse(await _call(completion_id, store.update_metadata, key_id, completion_id, body.metadata or {}))


@router.delete("/v1/chat/completions/{completion_id}", responses=documented(CompletionDeleted))
async def delete_chat_completion(completion_id: str, request: Request) -> JSONResponse:
    store, key_id = _store(request)
    await _call(completion_id, store.delete, key_id, completion_id)
    return JSONResponse({"id": completion_id, "object": "chat.completion.deleted", "deleted": True})


@router.get("/v1/chat/completions/{completion_id}/messages", responses=documented(StoredMessagePage))
async def list_chat_completion_messages(
    completion_id: str,
    request: Request,
    after: str | None = None,
    limit: int = Query(20, ge=1, le=MAX_PAGE_SIZE),
    order: Literal["asc", "desc"] = "asc",
) -> JSONResponse:
    """The messages the completion's request sent, in order unless `order=desc`; `after` takes a message id."""
    store, key_id = _store(request)
    found, has_more = await _call(completion_id, store.messages, key_id, completion_id, limit=limit, after=after,
                                  order=order)
    return JSONResponse(list_page(found, has_more))
