"""/v1/conversations: stored chats (the seed's /api/conversations), and the hook that lets a chat
completion continue one (`conversation_id`): its history goes before the new messages, so the next turn
reuses the earlier turns' KV from the prefix cache, and the new turn plus the reply are appended.

A conversation belongs to the key that made it; any other key gets a 404, as for an unknown id.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from llmserve.platform.conversations import Conversation, ConversationNotFound, ConversationStore
from llmserve.platform.keys import ApiKey
from llmserve.server.errors import APIError
from llmserve.server.gateway import request_key
from llmserve.server.state import ServerState, get_state

router = APIRouter()


def _not_found(conversation_id: str, param: str | None = None) -> APIError:
    return APIError(
        404, f"No conversation found with id '{conversation_id}'.", param=param, code="conversation_not_found"
    )


def _store(state: ServerState) -> ConversationStore:
    if state.platform is None or state.platform.conversations is None:
        raise APIError(404, "Conversation storage is not enabled on this server.", code="not_enabled")
    return state.platform.conversations


def _key_id(key: ApiKey | None) -> str | None:
    return key.id if key is not None else None


# ---- the chat completion hook ---------------------------------------------------------------------


@dataclass
class ConversationTurn:
    """A chat completion's place in a stored conversation."""

    store: ConversationStore
    key_id: str | None
    conversation_id: str
    parent_id: str | None  # the message the new turn follows
    history: list[dict[str, str]]
    reply_id: str | None = None

    async def save(self, messages: list[dict[str, str]], reply: str, reply_tokens: int) -> None:
        """Append the request's messages, then the assistant's reply, after `parent_id`."""
        self.reply_id = await asyncio.to_thread(self._save, messages, reply, reply_tokens)

    def _save(self, messages: list[dict[str, str]], reply: str, reply_tokens: int) -> str:
        parent = self.parent_id
        for message in messages:
            parent = self.store.append(
                self.key_id, self.conversation_id, message["role"], message["content"], parent_id=parent
            ).id
        return self.store.append(
            self.key_id, self.conversation_id, "assistant", reply, token_count=reply_tokens, parent_id=parent
        ).id

    def headers(self) -> dict[str, str]:
        return {"x-conversation-id": self.conversation_id}


async def open_turn(
    state: ServerState, key: ApiKey | None, conversation_id: str | None, parent_message_id: str | None
) -> ConversationTurn | None:
    """The stored history a chat completion continues (404 for an unknown or foreign conversation, 400
    for a parent message that is not in it)."""
    if conversation_id is None:
        if parent_message_id is not None:
            raise APIError(400, "parent_message_id needs a conversation_id.", param="parent_message_id")
        return None
    store = _store(state)
    key_id = _key_id(key)
    try:
        path = await asyncio.to_thread(store.history, key_id, conversation_id, parent_message_id)
    except ConversationNotFound:
        raise _not_found(conversation_id, "conversation_id") from None
    except ValueError as exc:
        raise APIError(400, str(exc), param="parent_message_id") from None
    history = [{"role": m.role, "content": m.content} for m in path]
    parent = path[-1].id if path else None
    return ConversationTurn(store, key_id, conversation_id, parent, history)


# ---- endpoints ------------------------------------------------------------------------------------


class NewMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str = Field(pattern="^(system|developer|user|assistant)$")
    content: str


class CreateConversation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: str | None = Field(None, max_length=200)
    model: str | None = None
    messages: list[NewMessage] = Field(default_factory=list)


def _conversation_json(conversation: Conversation, with_messages: bool = True) -> dict[str, Any]:
    body = conversation.as_dict(with_messages)
    if with_messages:
        body["total_tokens"] = sum(m.token_count or 0 for m in conversation.messages)
    return body


@router.post("/v1/conversations")
async def create_conversation(body: CreateConversation, request: Request) -> JSONResponse:
    store = _store(get_state(request))
    messages = [m.model_dump() for m in body.messages]
    key_id = _key_id(request_key(request.state))
    conversation = await asyncio.to_thread(store.create, key_id, body.title, body.model, messages)
    stored = await asyncio.to_thread(store.get, key_id, conversation.id)
    return JSONResponse(_conversation_json(stored), status_code=201)


@router.get("/v1/conversations")
async def list_conversations(
    request: Request, limit: int = Query(20, ge=1, le=100), after: str | None = None
) -> JSONResponse:
    store = _store(get_state(request))
    key_id = _key_id(request_key(request.state))
    items, has_more = await asyncio.to_thread(store.list, key_id, limit, after)
    data = [_conversation_json(c, with_messages=False) for c in items]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }
    )


@router.get("/v1/conversations/{conversation_id}")
async def get_conversation(conversation_id: str, request: Request) -> JSONResponse:
    store = _store(get_state(request))
    try:
        conversation = await asyncio.to_thread(store.get, _key_id(request_key(request.state)), conversation_id)
    except ConversationNotFound:
        raise _not_found(conversation_id) from None
    return JSONResponse(_conversation_json(conversation))


@router.delete("/v1/conversations/{conversation_id}")
async def delete_conversation(conversation_id: str, request: Request) -> Response:
    store = _store(get_state(request))
    try:
        await asyncio.to_thread(store.delete, _key_id(request_key(request.state)), conversation_id)
    except ConversationNotFound:
        raise _not_found(conversation_id) from None
    return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})
