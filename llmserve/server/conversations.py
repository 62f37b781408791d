"""/v1/conversations: stored chats (the seed's /api/conversations), and the hook that lets a chat
completion continue one (`conversation_id`; a Responses API request's `conversation` uses it too,
`start_turn`): its history goes before the new messages, so the next turn reuses the earlier turns' KV
from the prefix cache, and the new turn plus the reply are appended.

A conversation belongs to the key that made it; any other key gets a 404, as for an unknown id.
Its messages are listed a page at a time (`GET /v1/conversations/{id}/messages`, in the shape of OpenAI's
Conversations items list). What a conversation may hold is bounded by the store's limits (413).

OpenAI's Conversations API is served over the same conversations (what the `openai` SDK's `conversations`
and `conversations.items` call): `items` and `metadata` at creation, `metadata` (and `title`) updated, and
`/v1/conversations/{id}/items` to list (the active branch), add (after its head), read and delete items:
messages, function calls, their outputs and reasoning, each a stored message (`conversation_items`). Other item
types (built-in tools' calls) are 400s, and so is `include`. Chat's tools and tool messages, and a Responses
request's function calls, go into a stored conversation as those items.

When the history plus the new turn would not fit the model's context window, `truncation: "auto"` drops
the oldest turns (never the leading system messages, never the request's own messages) and the response
says how many messages it dropped in `x-llmserve-truncated-messages`; `"disabled"` (the default, as in
OpenAI's Responses API) leaves the prompt whole, so the request fails with the usual 400. Without a stored
conversation, `"auto"` drops the oldest turns of the request's own messages, never its last turn
(`split_last_turn`): what a Responses API request continuing a long chain needs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from llmserve.platform.conversations import (
    BranchTotals,
    Conversation,
    ConversationLimitExceeded,
    ConversationNotFound,
    ConversationStore,
    Message,
    MessageNotFound,
    part_image_urls,
    stored_size,
)
from llmserve.platform.keys import ApiKey
from llmserve.platform.paging import MAX_PAGE_SIZE
from llmserve.server.conversation_items import (
    MAX_ITEMS,
    ChatMessages,
    ConversationItem,
    as_item,
    chat_history,
    check_call_ids,
    item_turns,
    stored_turns,
)
from llmserve.server.errors import APIError, unsupported
from llmserve.server.gateway import Platform, platform_of, request_key
from llmserve.server.openapi import documented
from llmserve.server.protocol import Metadata, list_page

router = APIRouter()

TRUNCATED_HEADER = "x-llmserve-truncated-messages"
Truncation = Literal["auto", "disabled"]


def _not_found(conversation_id: str, param: str | None = None) -> APIError:
    return APIError(
        404, f"No conversation found with id '{conversation_id}'.", param=param, code="conversation_not_found"
    )


def _store(platform: Platform | None) -> ConversationStore:
    if platform is None or platform.conversations is None:
        raise APIError(404, "Conversation storage is not enabled on this server.", code="not_enabled")
    return platform.conversations


def _key_id(key: ApiKey | None) -> str | None:
    return key.id if key is not None else None


def _too_large(exc: ConversationLimitExceeded, field: str = "messages") -> APIError:
    """The 413, its parameter named after the request's `field` that held the messages ("items": an item each)."""
    param = exc.param.replace("messages", field, 1)
    return APIError(413, exc.message.replace("messages[", f"{field}[", 1), param=param, code=exc.code)


# ---- the chat completion hook ---------------------------------------------------------------------


@dataclass
class ConversationTurn:
    """A chat completion's place in a stored conversation."""

    store: ConversationStore
    key_id: str | None
    conversation_id: str
    parent_id: str | None  # the message the new turn follows
    history: ChatMessages
    reply_id: str | None = None
    truncated: int = 0  # history messages left out of the prompt to fit the context window

    async def save(self, messages: ChatMessages, reply: dict[str, Any], reply_tokens: int) -> None:
        """Append the request's messages (with their images and tool calls), then the assistant's reply (a chat
        message, `reply_message`), after `parent_id`, all at once."""
        self.reply_id = await asyncio.to_thread(self._save, messages, reply, reply_tokens)

    def _save(self, messages: ChatMessages, reply: dict[str, Any], reply_tokens: int) -> str:
        turns = stored_turns([*messages, reply])
        turns[-1]["token_count"] = reply_tokens
        return self.store.extend(self.key_id, self.conversation_id, turns, self.parent_id)[-1].id

    def headers(self) -> dict[str, str]:
        return {"x-conversation-id": self.conversation_id, TRUNCATED_HEADER: str(self.truncated)}


def turn_messages(turn: ConversationTurn | None, new_messages: ChatMessages) -> ChatMessages:
    """A chat's messages after its stored conversation's (none without one)."""
    return [*turn.history, *new_messages] if turn is not None else list(new_messages)


async def open_turn(
    platform: Platform | None,
    key: ApiKey | None,
    conversation_id: str | None,
    parent_message_id: str | None,
    new_messages: ChatMessages,
) -> ConversationTurn | None:
    """The stored history a chat completion continues (404 for an unknown or foreign conversation, 400
    for a parent message that is not in it, 413 when the new turn would break the store's limits)."""
    if conversation_id is None:
        if parent_message_id is not None:
            raise APIError(400, "parent_message_id needs a conversation_id.", param="parent_message_id")
        return None
    return await start_turn(_store(platform), _key_id(key), conversation_id, new_messages, parent_message_id)


async def start_turn(
    store: ConversationStore,
    key_id: str | None,
    conversation_id: str,
    new_messages: ChatMessages,
    parent_message_id: str | None = None,
) -> ConversationTurn:
    """`open_turn` in a given store, for the caller's key (None in local mode)."""
    check_call_ids(new_messages)
    try:
        path = await asyncio.to_thread(_turn_context, store, key_id, conversation_id, parent_message_id, new_messages)
    except ConversationNotFound:
        raise _not_found(conversation_id, "conversation_id") from None
    except ConversationLimitExceeded as exc:
        raise _too_large(exc) from None
    except ValueError as exc:
        raise APIError(400, str(exc), param="parent_message_id") from None
    parent = path[-1].id if path else None
    return ConversationTurn(store, key_id, conversation_id, parent, chat_history(path))


def _turn_context(
    store: ConversationStore, key_id: str | None, conversation_id: str, up_to: str | None, new_messages: ChatMessages
) -> list[Message]:
    """The history the turn continues, once it is clear that the turn (its messages and the reply) fits
    the conversation's limits: checked before generating, so a reply is not computed and then lost."""
    path = store.history(key_id, conversation_id, up_to)
    existing = store.message_count(key_id, conversation_id)
    turns = stored_turns(new_messages)
    store.limits.check([stored_size(turn) for turn in turns], existing=existing + 1,
                       images=[part_image_urls(turn.get("parts", ())) for turn in turns])
    return path


# ---- fitting the history into the context window ------------------------------------------------


def fit_history(
    render: Callable[[ChatMessages], tuple[str, list[int]]],
    history: ChatMessages,
    new_messages: ChatMessages,
    max_prompt_tokens: int,
    truncation: Truncation,
) -> tuple[str, list[int], int]:
    """The prompt (text and ids, as `render` makes them) of the history then the new messages, and how
    many history messages were left out.

    With "auto", when the whole history does not leave `max_prompt_tokens`, the fewest oldest turns
    (a user message with what follows it) are left out that make it fit, found by bisection; the
    leading system messages stay. If even none of the turns fits, the prompt without them is returned
    and the engine's context check refuses it. Runs off the event loop: it templates and tokenizes.
    """
    text, ids = render(history + new_messages)
    if truncation == "disabled" or len(ids) <= max_prompt_tokens or max_prompt_tokens < 1:
        return text, ids, 0
    system, turns = _split_turns(history)
    if not turns:
        return text, ids, 0

    def without(dropped: int) -> tuple[str, list[int]]:
        return render(system + [m for turn in turns[dropped:] for m in turn] + new_messages)

    low, high = 1, len(turns)  # the answer is in [low, high]: dropping every turn is the last resort
    best = without(high)
    if len(best[1]) > max_prompt_tokens:
        return best[0], best[1], sum(len(turn) for turn in turns)
    while low < high:
        middle = (low + high) // 2
        attempt = without(middle)
        if len(attempt[1]) <= max_prompt_tokens:
            high, best = middle, attempt
        else:
            low = middle + 1
    return best[0], best[1], sum(len(turn) for turn in turns[:high])


def split_last_turn(messages: ChatMessages) -> tuple[ChatMessages, ChatMessages]:
    """(the messages before the last turn, the last turn: from the last user message on). Without a user
    message, everything is the last turn."""
    last_user = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "user"), 0)
    return messages[:last_user], messages[last_user:]


def _split_turns(history: ChatMessages) -> tuple[ChatMessages, list[ChatMessages]]:
    """The leading system messages, and the rest as turns that each start at a user message (whatever
    precedes the first user message is a turn of its own)."""
    start = 0
    while start < len(history) and history[start]["role"] == "system":
        start += 1
    turns: list[ChatMessages] = []
    for message in history[start:]:
        if not turns or message["role"] == "user":
            turns.append([])
        turns[-1].append(message)
    return history[:start], turns


# ---- OpenAI's conversation items ------------------------------------------------------------------

def _no_include(
    include: Annotated[list[str] | None, Query(description="Not supported here: any value is a 400.")] = None,
    include_brackets: Annotated[list[str] | None, Query(alias="include[]", include_in_schema=False)] = None,
) -> None:
    """OpenAI's `include` (the `openai` SDK sends it as `include[]`): none of what it adds is made here."""
    if include or include_brackets:
        raise unsupported("include", "include is not supported here: reasoning items are listed with the encrypted "
                                     "content they were added with, and nothing else it adds is kept.")


NO_INCLUDE = Depends(_no_include)


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
    # OpenAI's: its first message items (instead of `messages`), metadata, and an end user's id (not used here).
    items: list[dict[str, Any]] | None = Field(None, max_length=MAX_ITEMS)
    metadata: Metadata | None = None
    safety_identifier: str | None = Field(None, max_length=64)


class AddItems(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_ITEMS)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ConversationObject(_Response):
    id: str
    object: Literal["conversation"]
    title: str | None
    model: str | None
    metadata: dict[str, str]
    created_at: int
    updated_at: int


class ConversationSummary(ConversationObject):
    message_count: int
    total_tokens: int


class MessageObject(_Response):
    id: str
    object: Literal["conversation.message"]
    parent_id: str | None
    role: str
    content: str
    images: list[str]
    tool_call: dict[str, str] | None  # an assistant's call of a tool: {"call_id", "name", "arguments"}
    tool_call_id: str | None  # a tool's output: the call it answers
    reasoning: dict[str, Any] | None  # an assistant's reasoning: {"summary", "encrypted_content"?}
    token_count: int | None
    created_at: int


class _Page(_Response):
    object: Literal["list"]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ConversationPage(_Page):
    data: list[ConversationObject]


class MessagePage(_Page):
    data: list[MessageObject]


class ItemPage(_Page):
    data: list[ConversationItem]


class ConversationDeleted(_Response):
    id: str
    object: Literal["conversation.deleted"]
    deleted: bool


def _summary_json(conversation: Conversation, totals: BranchTotals) -> dict[str, Any]:
    return {**conversation.as_dict(with_messages=False), "message_count": totals.messages, "total_tokens": totals.tokens}


def _item_not_found(item_id: str) -> APIError:
    return APIError(404, f"No item found with id '{item_id}'.", code="item_not_found")


@router.post("/v1/conversations", status_code=201, responses=documented(ConversationSummary, status=201))
async def create_conversation(body: CreateConversation, request: Request) -> JSONResponse:
    """A new conversation, optionally with its first messages (`messages`, or OpenAI's message `items`) and
    metadata; answered without the messages (list them with GET /v1/conversations/{id}/messages or /items)."""
    if body.items is not None and "messages" in body.model_fields_set:
        raise APIError(400, "Give either items or messages, not both.", param="items")
    store = _store(platform_of(request))
    field = "messages" if body.items is None else "items"
    messages = [m.model_dump() for m in body.messages] if body.items is None else item_turns(body.items)
    key_id = _key_id(request_key(request.state))
    try:
        conversation = await asyncio.to_thread(
            store.create, key_id, body.title, body.model, messages, body.metadata
        )
    except ConversationLimitExceeded as exc:
        raise _too_large(exc, field) from None
    summary = await asyncio.to_thread(store.summary, key_id, conversation.id)
    return JSONResponse(_summary_json(*summary), status_code=201)


@router.get("/v1/conversations", responses=documented(ConversationPage))
async def list_conversations(
    request: Request, limit: int = Query(20, ge=1, le=MAX_PAGE_SIZE), after: str | None = None
) -> JSONResponse:
    store = _store(platform_of(request))
    key_id = _key_id(request_key(request.state))
    items, has_more = await asyncio.to_thread(store.list, key_id, limit, after)
    return JSONResponse(list_page([c.as_dict(with_messages=False) for c in items], has_more))


@router.get("/v1/conversations/{conversation_id}", responses=documented(ConversationSummary))
async def get_conversation(conversation_id: str, request: Request) -> JSONResponse:
    """The conversation with the size of its active branch, without the messages themselves."""
    store = _store(platform_of(request))
    try:
        summary = await asyncio.to_thread(store.summary, _key_id(request_key(request.state)), conversation_id)
    except ConversationNotFound:
        raise _not_found(conversation_id) from None
    return JSONResponse(_summary_json(*summary))


async def _message_page(
    request: Request, conversation_id: str, limit: int, order: Literal["asc", "desc"], after: str | None,
    before: str | None = None,
) -> tuple[list[Message], bool]:
    """A page of the active branch's messages (`ConversationStore.messages`), and whether more follow."""
    store = _store(platform_of(request))
    key_id = _key_id(request_key(request.state))
    try:
        return await asyncio.to_thread(store.messages, key_id, conversation_id, limit, order, after, before)
    except ConversationNotFound:
        raise _not_found(conversation_id) from None


@router.get("/v1/conversations/{conversation_id}/messages", responses=documented(MessagePage))
async def list_messages(
    conversation_id: str,
    request: Request,
    limit: int = Query(20, ge=1, le=MAX_PAGE_SIZE),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
    before: str | None = None,
) -> JSONResponse:
    """A page of the active branch's messages, newest first unless `order=asc`; `after`/`before` take
    a message id from a previous page."""
    page, has_more = await _message_page(request, conversation_id, limit, order, after, before)
    return JSONResponse(list_page([m.as_dict() for m in page], has_more))


class UpdateConversation(BaseModel):
    model_config = ConfigDict(extra="forbid")
    title: str | None = Field(None, max_length=200)
    metadata: Metadata | None = None


class ConversationTree(_Response):
    object: Literal["conversation.tree"]
    id: str
    head_message_id: str | None
    data: list[MessageObject]


@router.post("/v1/conversations/{conversation_id}", responses=documented(ConversationSummary))
async def update_conversation(conversation_id: str, body: UpdateConversation, request: Request) -> JSONResponse:
    """OpenAI's conversation update: what is given replaces what was, the metadata (null: none) or the title
    (null or blank: untitled); neither changes nothing."""
    store = _store(platform_of(request))
    key_id = _key_id(request_key(request.state))
    try:
        await asyncio.to_thread(store.update, key_id, conversation_id, **body.model_dump(exclude_unset=True))
        summary = await asyncio.to_thread(store.summary, key_id, conversation_id)
    except ConversationNotFound:
        raise _not_found(conversation_id) from None
    return JSONResponse(_summary_json(*summary))


@router.get("/v1/conversations/{conversation_id}/tree", responses=documented(ConversationTree))
async def conversation_tree(conversation_id: str, request: Request) -> JSONResponse:
    """Every message of every branch, oldest first, and the head of the active branch (each message
    names its parent): what the chat page shows branches from."""
    store = _store(platform_of(request))
    try:
        conversation, messages = await asyncio.to_thread(
            store.tree, _key_id(request_key(request.state)), conversation_id
        )
    except ConversationNotFound:
        raise _not_found(conversation_id) from None
    return JSONResponse({
        "object": "conversation.tree", "id": conversation.id, "head_message_id": conversation.head_message_id,
        "data": [m.as_dict() for m in messages],
    })


@router.delete("/v1/conversations/{conversation_id}", responses=documented(ConversationDeleted))
async def delete_conversation(conversation_id: str, request: Request) -> Response:
    store = _store(platform_of(request))
    try:
        await asyncio.to_thread(store.delete, _key_id(request_key(request.state)), conversation_id)
    except ConversationNotFound:
        raise _not_found(conversation_id) from None
    return JSONResponse({"id": conversation_id, "object": "conversation.deleted", "deleted": True})


@router.get("/v1/conversations/{conversation_id}/items", responses=documented(ItemPage), dependencies=[NO_INCLUDE])
async def list_items(
    conversation_id: str,
    request: Request,
    limit: int = Query(20, ge=1, le=MAX_PAGE_SIZE),
    order: Literal["asc", "desc"] = "desc",
    after: str | None = None,
) -> JSONResponse:
    """OpenAI's items list: a page of the active branch's messages as items, newest first unless
    `order=asc`; `after` takes an item id from a previous page."""
    page, has_more = await _message_page(request, conversation_id, limit, order, after)
    return JSONResponse(list_page([as_item(m) for m in page], has_more))


@router.post("/v1/conversations/{conversation_id}/items", responses=documented(ItemPage), dependencies=[NO_INCLUDE])
async def add_items(conversation_id: str, body: AddItems, request: Request) -> JSONResponse:
    """Append items (messages, function calls, their outputs), in order, after the active branch's head (all of
    them or, past the store's limits, none: 413); answered with the items made, oldest first."""
    store = _store(platform_of(request))
    turns = item_turns(body.items)
    try:
        added = await asyncio.to_thread(store.extend, _key_id(request_key(request.state)), conversation_id, turns)
    except ConversationNotFound:
        raise _not_found(conversation_id) from None
    except ConversationLimitExceeded as exc:
        raise _too_large(exc, "items") from None
    return JSONResponse(list_page([as_item(m) for m in added], has_more=False))


@router.get("/v1/conversations/{conversation_id}/items/{item_id}", responses=documented(ConversationItem),
            dependencies=[NO_INCLUDE])
async def get_item(conversation_id: str, item_id: str, request: Request) -> JSONResponse:
    """One message of the conversation (of any branch) as an item."""
    store = _store(platform_of(request))
    try:
        message = await asyncio.to_thread(store.message, _key_id(request_key(request.state)), conversation_id, item_id)
    except ConversationNotFound:
        raise _not_found(conversation_id) from None
    except MessageNotFound:
        raise _item_not_found(item_id) from None
    return JSONResponse(as_item(message))


@router.delete("/v1/conversations/{conversation_id}/items/{item_id}", responses=documented(ConversationObject))
async def delete_item(conversation_id: str, item_id: str, request: Request) -> JSONResponse:
    """Delete one message: its children, on every branch, follow its parent instead, so the active branch loses
    just that message. Answered with the conversation, as OpenAI's."""
    store = _store(platform_of(request))
    try:
        conversation = await asyncio.to_thread(
            store.delete_message, _key_id(request_key(request.state)), conversation_id, item_id
        )
    except ConversationNotFound:
        raise _not_found(conversation_id) from None
    except MessageNotFound:
        raise _item_not_found(item_id) from None
    return JSONResponse(conversation.as_dict(with_messages=False))
