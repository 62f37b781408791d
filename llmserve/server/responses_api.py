"""OpenAI's Responses API as a chat completion: the request's shapes, and `answer`, which translates one.

A request is translated into a chat completion (its `input` items into messages, `instructions` into the
first system message, its flat function tools into chat's, `text.format` into `response_format`), run by
the caller's chat endpoint (the server's, or a gateway platform's: so keys, limits, metering, safety,
disconnects and the tool and reasoning parsers are chat's), and its answer translated back: output items
(`reasoning`, `message`, `function_call`) and the Responses usage; streamed, chat's chunks become the
Responses events, each numbered by `sequence_number`. As in the Responses API, function tools are strict
unless they say otherwise. `include` may ask for the output text's logprobs (chat's) and for reasoning items'
`encrypted_content` (their text in base64: stateless clients send reasoning items back, and chat templates
leave earlier reasoning out, so nothing reads it).

Where the platform keeps responses (`Storage`), a response is stored unless the request says `store: false`
(OpenAI's default), for its key alone: GET /v1/responses/{id} reads it back (`stored_responses`), and a request
naming it as `previous_response_id` continues its conversation (its turns' input and output items come before
the request's input; its `instructions` do not carry over, as in OpenAI's API). A request naming a stored
`conversation` (/v1/conversations, the key's own) continues it through chat's conversation hook: its messages come
before the request's input (after the instructions, which the conversation does not keep), and once answered the
input's items (messages, function calls, their outputs) and the output's reasoning, text and function calls are
appended to it, as chat's `conversation_id` keeps a turn. Without storage (`--no-platform`) `store`
is answered false, and `previous_response_id` and `conversation` are 400s. `truncation: "auto"` is chat's: the
oldest turns that do not fit the context window are left out of the prompt, never the last.

`background: true` (stored responses only; not with `store: false`) answers at once with the response `queued`,
stored; a task of the process runs it (`in_progress`), on a request detached from the client's connection, and
replaces it with the finished response, or a `failed` one with chat's error. Clients poll GET /v1/responses/{id};
POST /v1/responses/{id}/cancel stops it (`cancelled`). With `stream: true` too, the task produces the events into
a resumable stream's buffer (`server/streaming.py`, one that runs on unfollowed) that the request follows, and GET
/v1/responses/{id}?stream=true follows again. The tasks are the platform's, so the server's shutdown stops them
(`failed`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat
from starlette.requests import Request
from starlette.types import Message

from llmserve.errors import InvalidRequestError
from llmserve.platform.conversations import ConversationStore
from llmserve.platform.responses import ResponseChainBroken, ResponseNotFound, ResponseStore, with_ids
from llmserve.server import errors
from llmserve.server.chat_translation import (
    RunChat,
    chat_chunks,
    chat_request,
    chat_tokenize_body,
    error_reply,
    renamed,
    renamer,
    whole_completion,
)
from llmserve.server.conversation_items import reply_message
from llmserve.server.conversations import ConversationTurn, start_turn
from llmserve.server.messages import template_messages, wire_messages
from llmserve.server.openapi import documented
from llmserve.server.protocol import ChatCompletionRequest, ChatMessage, Int64, Metadata, RequestBody, now
from llmserve.server.streaming import STREAM_ID_HEADER, EventIds, StreamRegistry, event_stream

logger = logging.getLogger(__name__)

# Chat's parameter names in errors -> the Responses request's own.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
           "conversation_id": "conversation"}
_rename = renamer(_PARAMS, "input")
# Known Responses fields this server does not implement (each would change the output).
_UNSUPPORTED = ("prompt",)
# `include` values: what they add to items this server makes (logprobs, reasoning), or to items of tools and
# inputs it refuses (so there is never anything of theirs to add).
LOGPROBS = "message.output_text.logprobs"
ENCRYPTED_REASONING = "reasoning.encrypted_content"
Includable = Literal[
    "message.output_text.logprobs", "reasoning.encrypted_content", "web_search_call.action.sources",
    "web_search_call.results", "code_interpreter_call.outputs", "computer_call_output.output.image_url",
    "file_search_call.results", "message.input_image.image_url",
]


class ConversationRef(BaseModel):
    """`conversation` as an object: the stored conversation's id."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1)


class ResponsesRequest(RequestBody):
    """The Responses API's request, as far as it is served here (other fields are 400s)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int64 | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, ge=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None  # "auto": the oldest turns go when the context is full
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    store: StrictBool | None = None  # unset: stored where responses are kept (OpenAI's default)
    background: StrictBool | None = None  # true: answered queued at once, then run by a task of the process
    previous_response_id: str | None = Field(None, min_length=1, max_length=64)
    conversation: ConversationRef | Annotated[str, Field(min_length=1)] | None = None  # its id, or {"id": ...}
    # metadata only
    metadata: Metadata | None = None
    user: str | None = None
    safety_identifier: str | None = Field(None, max_length=128)
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=1024)
    service_tier: str | None = None
    include: list[Includable] | None = None
    top_logprobs: Int64 | None = Field(None, ge=0, le=20)  # with logprobs, whether `include` asks for them or not
    # Calls of built-in tools allowed: this server runs none (its tools are the client's functions), so none is made.
    max_tool_calls: Int64 | None = Field(None, ge=1)
    # known, not served
    prompt: Any = None


class InputTokensRequest(RequestBody):
    """POST /v1/responses/input_tokens: what a Responses request's input tokens depend on."""

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=64)
    conversation: ConversationRef | Annotated[str, Field(min_length=1)] | None = None


class InputTokens(BaseModel):
    object: Literal["response.input_tokens"]
    input_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    """A response, as the Responses API answers it (the fields this server fills)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed", "queued", "cancelled"]
    model: str
    output: list[dict[str, Any]]
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None = None
    temperature: float | None
    top_p: float | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    truncation: Literal["auto", "disabled"]
    store: bool
    background: bool = False
    metadata: dict[str, str]
    user: str | None
    previous_response_id: str | None
    conversation: ConversationRef | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None
    usage: ResponseUsage | None


# Streamed, each event names its type (`event:`) as OpenAI's do, besides the JSON in `data:`.
DOCUMENTED = documented(ResponseObject, stream=True)
DOCUMENTED[200]["content"]["text/event-stream"]["schema"] = {
    "type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"}}, "required": ["data"],
}



@dataclass(frozen=True)
class Storage:
    """Where the caller's responses are kept: the store, and the caller's key (None in local mode); the background
    responses running in this process, by id (the platform's, shared by its requests: the strong references that
    keep their tasks alive); its conversations (None where they are not kept); and the app's resumable streams."""

    store: ResponseStore
    key_id: str | None
    running: dict[str, asyncio.Task[None]]
    conversations: ConversationStore | None = None
    streams: StreamRegistry | None = None  # where a streamed background response's events are buffered


@dataclass(frozen=True)
class _Turn:
    """A request as the chat completion it runs: the chat request (validated, and as JSON), the input items it
    sent (with their ids), and its turn in the stored conversation it names with that turn's messages."""

    chat: ChatCompletionRequest
    payload: dict[str, Any]
    input_items: list[dict[str, Any]]
    turn: ConversationTurn | None
    turn_messages: list[dict[str, Any]]


async def _as_chat(body: ResponsesRequest, storage: Storage | None) -> _Turn:
    """`body` as a chat completion: its instructions, then the stored conversation it continues (its previous
    response's turns, or its stored conversation's messages), then its input."""
    conversation_id = _conversation_id(body, storage)
    context = await _context(body.previous_response_id, storage)
    input_items = with_ids(_input_items(body))
    messages = _messages(context, input_items)
    turn, turn_messages = None, []
    if conversation_id is not None:
        assert storage is not None and storage.conversations is not None
        turn, turn_messages = await renamed(
            _open_turn(storage.conversations, storage.key_id, conversation_id, body, messages), _rename)
    history = wire_messages(turn.history) if turn is not None else []
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat, payload = _chat_request(body, [*instructions, *history, *messages])
    return _Turn(chat, payload, input_items, turn, turn_messages)


async def input_token_request(body: InputTokensRequest, storage: Storage | None = None) -> dict[str, Any]:
    """The /tokenize body whose count is the input tokens of the response `body` describes: the prompt its chat
    completion would template (before `truncation: "auto"` cut it)."""
    request = ResponsesRequest.model_validate({**body.model_dump(exclude_unset=True), "input": body.input})
    return chat_tokenize_body(body.model, (await _as_chat(request, storage)).payload)


async def answer(body: ResponsesRequest, run_chat: RunChat, storage: Storage | None = None) -> Response:
    """The response to `body`, by way of a chat completion that `run_chat` runs; kept in `storage` unless the
    request says not to; its turn appended to the stored conversation it names. In background, the response
    stored `queued`, the run left to a task of the process: `run_chat` then runs on a `detached` request."""
    _check_fields(body, storage)
    prepared = await _as_chat(body, storage)
    response_id = f"resp_{uuid.uuid4().hex}"
    if body.background:
        assert storage is not None  # _check_fields
        return await _start_in_background(body, prepared, run_chat, storage, response_id)
    keep = _Keeper(storage if body.store is not False else None, prepared.input_items, body.previous_response_id,
                   prepared.turn, prepared.turn_messages)
    return await _run(body, prepared, run_chat, response_id, keep)


async def _run(body: ResponsesRequest, prepared: _Turn, run_chat: RunChat, response_id: str,
               keep: _Keeper) -> Response:
    """The chat completion run, as the response `response_id` that `keep` keeps: its JSON, or its events when
    streamed; chat's error answer as it is."""
    reply = await renamed(run_chat(prepared.chat, prepared.payload), _rename)
    headers = {k: v for k, v in reply.headers.items() if k.startswith("x-")}
    if reply.status_code != 200:  # an error answered rather than raised (a gateway's replica's)
        return error_reply(reply, _rename)
    if body.stream:
        assert isinstance(reply, StreamingResponse)
        events = ResponseEvents(body, response_id, keep).events(reply.body_iterator)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
    completion = await whole_completion(reply)
    choice = completion["choices"][0]
    message = choice["message"]
    output = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(_item_id("rs"), message["reasoning_content"], _encrypted(body)))
    if message.get("content"):
        output.append(_message_item(_item_id("msg"), message["content"],
                                    logprobs=(choice.get("logprobs") or {}).get("content") or []))
    for call in message.get("tool_calls") or ():
        output.append(_call_item(_item_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"]))
    answer_json = _response(body, response_id, completion["model"], output, choice["finish_reason"], completion["usage"],
                            stored=keep.stores)
    return JSONResponse(await keep(answer_json), headers=headers)


# ---- background responses --------------------------------------------------------------------------


def detached(request: Request) -> Request:
    """`request` as a background response's run takes it: the same scope (its app, and its state with the key the
    auth middleware found) without the client's connection, so the run never sees the client leave (it leaves
    once answered) and is not aborted for it."""
    return Request(request.scope, receive=_never_disconnects)


async def _never_disconnects() -> Message:
    forever: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
    return await forever


async def _start_in_background(body: ResponsesRequest, prepared: _Turn, run_chat: RunChat, storage: Storage,
                               response_id: str) -> Response:
    """The response stored `queued`, and a task of the process started to run it (held in `storage.running`
    until it ends): answered with the queued response, or, streamed, with the events the task buffers (followed
    again with GET /v1/responses/{id}?stream=true)."""
    queued = _response(body, response_id, body.model or "", [], None, None, status="queued", stored=True)
    await asyncio.to_thread(storage.store.save, storage.key_id, queued, prepared.input_items,
                            body.previous_response_id)
    keep = _Keeper(storage, prepared.input_items, body.previous_response_id, prepared.turn, prepared.turn_messages,
                   queued=queued)
    if body.stream:
        assert storage.streams is not None  # _check_background
        stream = storage.streams.open(response_id, storage.key_id, _background_events(body, prepared, run_chat, keep),
                                      outlives_followers=True)
        _hold(storage, response_id, stream.producer)
        return event_stream(stream.follow(), {STREAM_ID_HEADER: response_id})
    task = asyncio.create_task(_run_in_background(body, prepared, run_chat, keep),
                               name=f"background response {response_id}")
    _hold(storage, response_id, task)
    return JSONResponse(queued)


def _hold(storage: Storage, response_id: str, task: asyncio.Task[None]) -> None:
    """Keep the task running a background response in `storage.running` until it ends; with streams shared
    through Redis, a cancel or delete that another process answers stops it too."""
    storage.running[response_id] = task
    task.add_done_callback(lambda _: storage.running.pop(response_id, None))
    mirror = storage.streams.mirror if storage.streams is not None else None
    if mirror is not None:
        running = storage.running
        mirror.on_stop("background responses", lambda work_id: _cancel(running.get(work_id)))


def _cancel(task: asyncio.Task[None] | None) -> None:
    if task is not None:
        task.cancel()


async def _background_events(body: ResponsesRequest, prepared: _Turn, run_chat: RunChat,
                             keep: _Keeper) -> AsyncIterator[str]:
    """A streamed background response's events, numbered (`id:` their sequence numbers), as its task produces
    them into its buffer: `_run_in_background`'s run, streamed. A chat that fails ends them with an `error` and
    `response.failed`."""
    storage, queued = keep.storage, keep.queued
    assert storage is not None and queued is not None
    numbered = EventIds()
    events = ResponseEvents(body, queued["id"], keep)
    try:
        if not await _started(storage, queued):
            return  # cancelled (or deleted) before it started
        reply = await renamed(run_chat(prepared.chat, prepared.payload), _rename)
        if reply.status_code != 200:
            events.failure = _reply_error(reply)
            for event in events.failed(events.failure):
                yield numbered(event)
        else:
            assert isinstance(reply, StreamingResponse)
            async for event in events.events(reply.body_iterator):
                yield numbered(event)
    except asyncio.CancelledError:
        await _fail(storage, queued, _SHUT_DOWN)
        raise
    except Exception as exc:
        events.failure = _raised_failure(exc, queued["id"])
        for event in events.failed(events.failure):
            yield numbered(event)
    if events.failure is not None:
        await _fail(storage, queued, events.failure)


async def _run_in_background(body: ResponsesRequest, prepared: _Turn, run_chat: RunChat, keep: _Keeper) -> None:
    """Run a background response: `in_progress` (unless cancelled already), then finished (`keep` replaces it),
    or `failed` with the error chat answered or raised. Cancelled, it is `failed` as stopped by the server's
    shutdown, unless it ended first: a cancel stores `cancelled` before it stops the task."""
    storage, queued = keep.storage, keep.queued
    assert storage is not None and queued is not None
    try:
        if not await _started(storage, queued):
            return  # cancelled (or deleted) before it started
        reply = await _run(body, prepared, run_chat, queued["id"], keep)
        error = None if reply.status_code == 200 else _reply_error(reply)
    except asyncio.CancelledError:
        await _fail(storage, queued, _SHUT_DOWN)
        raise
    except Exception as exc:
        error = _raised_failure(exc, queued["id"])
    if error is not None:
        await _fail(storage, queued, error)


_SHUT_DOWN = {"code": "server_error", "message": "The server shut down before the response was finished."}


async def _started(storage: Storage, queued: dict[str, Any]) -> bool:
    """Store the background response `in_progress`; False where it was cancelled (or deleted) first."""
    return await asyncio.to_thread(storage.store.replace_unfinished, storage.key_id, {**queued, "status": "in_progress"})


def _raised_failure(exc: Exception, response_id: str) -> dict[str, Any]:
    """A failed response's `error` for what its run raised (logged where it is the server's fault)."""
    failure = errors.from_exception(exc)
    if failure.status >= 500:
        logger.exception("background response %s failed", response_id)
    return _failure(failure.status, failure.message)


def _reply_error(reply: Response) -> dict[str, Any]:
    """Chat's error answer as a failed response's `error`."""
    try:
        message = str(json.loads(bytes(reply.body))["error"]["message"])
    except (AttributeError, ValueError, TypeError, KeyError):  # not OpenAI's error shape
        message = f"The chat completion failed (HTTP {reply.status_code})."
    return _failure(reply.status_code, message)


def _failure(status: int, message: str) -> dict[str, Any]:
    """A failed response's `error` for chat's error of `status`: its message, under the code of OpenAI's few (its
    clients read no other) that says whose it is: a rate limit or quota, the request's, or the server's."""
    code = "rate_limit_exceeded" if status == 429 else "invalid_prompt" if 400 <= status < 500 else "server_error"
    return {"code": code, "message": message}


async def _fail(storage: Storage, queued: dict[str, Any], error: dict[str, Any]) -> None:
    """Store the background response `failed` with `error`, unless it has ended (or been cancelled) already."""
    try:
        await asyncio.to_thread(storage.store.replace_unfinished, storage.key_id,
                                {**queued, "status": "failed", "error": error})
    except Exception:
        logger.exception("could not store background response %s as failed", queued["id"])


async def stop_background(storage: Storage, response_id: str) -> None:
    """Stop the task running the background response `response_id`: if this process runs it (its engine request
    is aborted), once it has; otherwise, with streams shared through Redis, ask the process running it."""
    task = storage.running.get(response_id)
    if task is not None:
        task.cancel()
        await asyncio.wait([task])
    elif storage.streams is not None and storage.streams.mirror is not None:
        await storage.streams.mirror.ask_stop(response_id)


def _conversation(body: ResponsesRequest) -> ConversationRef | None:
    """The stored conversation the request names, as the response echoes it."""
    return ConversationRef(id=body.conversation) if isinstance(body.conversation, str) else body.conversation


def _conversation_id(body: ResponsesRequest, storage: Storage | None) -> str | None:
    """The id of the stored conversation the request continues, if it names one."""
    conversation = _conversation(body)
    if conversation is None:
        return None
    if body.previous_response_id is not None:
        raise _invalid("conversation and previous_response_id cannot be used together: give one of them.",
                       "conversation")
    if storage is None or storage.conversations is None:
        raise errors.unsupported("conversation", "conversation needs stored conversations, which this server does "
                                                 "not keep (it runs without its platform); send the whole "
                                                 "conversation as input.")
    return conversation.id


async def _open_turn(store: ConversationStore, key_id: str | None, conversation_id: str, body: ResponsesRequest,
                     messages: list[dict[str, Any]]) -> tuple[ConversationTurn, list[dict[str, Any]]]:
    """The request's turn in its stored conversation (chat's hook: a 404 for another key's or an unknown one), and
    its messages as the template takes them (and the conversation keeps them)."""
    templated = template_messages([ChatMessage.model_validate(message) for message in messages])
    return await start_turn(store, key_id, conversation_id, templated), templated


async def _context(previous_id: str | None, storage: Storage | None) -> list[dict[str, Any]]:
    """The stored conversation a request continues: its previous response's turns, as items."""
    if previous_id is None:
        return []
    if storage is None:
        raise errors.unsupported("previous_response_id", "previous_response_id needs stored responses, which this "
                                                         "server does not keep (it runs without its platform); send "
                                                         "the whole conversation as input.")
    try:
        return await asyncio.to_thread(storage.store.context, storage.key_id, previous_id)
    except ResponseNotFound:
        raise errors.APIError(404, f"Previous response with id '{previous_id}' not found.",
                              param="previous_response_id", code="previous_response_not_found") from None
    except ResponseChainBroken as exc:
        raise errors.APIError(400, f"Previous response with id '{previous_id}' continues '{exc.missing_id}', which "
                                   "is no longer stored: its conversation cannot be continued.",
                              param="previous_response_id", code="previous_response_not_found") from None


@dataclass(frozen=True)
class _Keeper:
    """What a finished response leaves: itself stored with the input items its request sent (where `storage` is
    given), and its turn in its stored conversation: `turn_messages` (the input's) and its output text. A
    background response (`queued`: as stored at first) replaces the stored one, created when it was, unless that one
    has ended (a cancel came first)."""

    storage: Storage | None
    input_items: list[dict[str, Any]]
    previous_id: str | None
    turn: ConversationTurn | None = None
    turn_messages: list[dict[str, Any]] = field(default_factory=list)
    queued: dict[str, Any] | None = None

    @property
    def stores(self) -> bool:
        return self.storage is not None

    async def __call__(self, response: dict[str, Any]) -> dict[str, Any]:
        """The response as answered: stored, or, where the store failed, said not to be."""
        if self.turn is not None:
            reply_tokens = (response["usage"] or {}).get("output_tokens", 0)
            await self.turn.save(self.turn_messages, _output_message(response["output"]), reply_tokens)
        if self.storage is None:
            return response
        if self.queued is not None:  # its failure to store fails the background response
            response = {**response, "created_at": self.queued["created_at"]}
            await asyncio.to_thread(self.storage.store.replace_unfinished, self.storage.key_id, response)
            return response
        try:
            await asyncio.to_thread(self.storage.store.save, self.storage.key_id, response, self.input_items,
                                    self.previous_id)
        except Exception:
            logger.exception("could not store response %s", response["id"])
            return {**response, "store": False}
        return response


def _output_message(output: list[dict[str, Any]]) -> dict[str, Any]:
    """What a conversation keeps of a response's output, as the chat message the model wrote: its reasoning (an
    item of the conversation that later prompts leave out), its messages' text and its function calls."""
    def texts(kind: str) -> str:
        return "".join(part["text"] for item in output if item["type"] == kind for part in item.get("content") or ())

    calls = [{"id": item["call_id"], "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    return reply_message(texts("message"), calls, texts("reasoning"))


def _invalid(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


# ---- the request, as a chat completion -----------------------------------------------------------


def _check_fields(body: ResponsesRequest, storage: Storage | None) -> None:
    """400s for the fields and stream options this server does not serve, and for background where it cannot
    run."""
    for name in _UNSUPPORTED:
        if getattr(body, name) is not None:
            raise errors.unsupported(name, f"{name} is not supported by this server.")
    if body.background:
        _check_background(body, storage)
    options = dict(body.stream_options or {})
    if options.pop("include_obfuscation", False):
        raise errors.unsupported("stream_options.include_obfuscation", "include_obfuscation is not supported here.")
    if options:
        raise _invalid(f"Unrecognized stream option: {next(iter(options))}", "stream_options")


def _check_background(body: ResponsesRequest, storage: Storage | None) -> None:
    """A background response is stored (clients poll it), and polled rather than streamed."""
    if storage is None:
        raise errors.unsupported("background", "background needs stored responses, which this server does not keep "
                                               "(it runs without its platform).")
    if body.store is False:
        raise _invalid("A background response is stored: store cannot be false with background.", "store")
    if body.stream and storage.streams is None:
        raise errors.unsupported("stream", "This server does not buffer streams: poll a background response "
                                           "(GET /v1/responses/{id}) instead of streaming it.")


def _chat_request(
    body: ResponsesRequest, messages: list[dict[str, Any]]
) -> tuple[ChatCompletionRequest, dict[str, Any]]:
    logprobs = body.top_logprobs is not None or LOGPROBS in (body.include or ())
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "stream": body.stream,
        "logprobs": logprobs or None, "top_logprobs": body.top_logprobs if logprobs else None,
        "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "tools": _tools(body.tools), "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls, "response_format": _response_format(body.text),
        "reasoning_effort": _reasoning_effort(body.reasoning), "metadata": body.metadata, "user": body.user,
        "safety_identifier": body.safety_identifier, "prompt_cache_key": body.prompt_cache_key,
        "service_tier": body.service_tier, "truncation": body.truncation,
    }
    if body.stream:
        fields["stream_options"] = {"include_usage": True}
    payload = {k: v for k, v in fields.items() if v is not None}
    return chat_request(payload, _rename, "input"), payload


def _text(content: Any, param: str, kinds: tuple[str, ...]) -> str:
    """An item's content as text: a string, or its text parts (of `kinds`) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid("content must be a string or a list of content parts.", param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise errors.unsupported(f"{param}[{j}]", f"Content parts of type {kind!r} are not supported here "
                                                      f"(this model reads {' and '.join(kinds)} parts).")
        texts.append(part["text"])
    return "".join(texts)


def _has_images(content: Any) -> bool:
    return isinstance(content, list) and any(isinstance(part, dict) and part.get("type") == "input_image"
                                             for part in content)


def _parts_with_images(content: list[Any], param: str) -> list[dict[str, Any]]:
    """A user message's `input_text` and `input_image` parts as chat's text and image_url parts."""
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise errors.unsupported(f"{param}[{j}]", "An input_image is read from its image_url (a data: or "
                                                          "http(s) URL) here, not a file_id.")
            image = {"url": part["image_url"]}
            if part.get("detail") is not None:
                image["detail"] = part["detail"]
            parts.append({"type": "image_url", "image_url": image})
        else:
            raise errors.unsupported(f"{param}[{j}]", f"Content parts of type {kind!r} are not supported here "
                                                      "(input_text and input_image).")
    return parts


def _string(item: dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise _invalid(f"{param}.{name} is required (a string).", f"{param}.{name}")
    return value


def _input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items (a string is one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": body.input}]}]
    return body.input


def _messages(context: list[dict[str, Any]], items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat's messages of the previous response's conversation (`context`), then of the request's items."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate([*context, *items]):
        param = f"input[{i - len(context)}]" if i >= len(context) else "previous_response_id"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _invalid(f"{param}.role must be one of user, system, developer, assistant.", f"{param}.role")
            content = item.get("content")
            if role == "user" and _has_images(content):
                messages.append({"role": role, "content": _parts_with_images(content, f"{param}.content")})
            else:
                parts = ("output_text", "refusal") if role == "assistant" else ("input_text",)
                messages.append({"role": role, "content": _text(content, f"{param}.content", parts)})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", param), "type": "function",
                    "function": {"name": _string(item, "name", param), "arguments": _string(item, "arguments", param)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"{param}.output", ("input_text",))
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param), "content": output})
        elif kind != "reasoning":  # an earlier turn's reasoning: chat templates leave it out
            raise errors.unsupported(f"{param}.type", f"Input items of type {kind!r} are not supported here.")
    return messages


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise errors.unsupported(f"tools[{i}].type", f"Tools of type {tool.get('type')!r} are not supported "
                                                         "here: only function tools.")
        unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
        if unknown:
            raise _invalid(f"Unrecognized tool field: {sorted(unknown)[0]}", f"tools[{i}].{sorted(unknown)[0]}")
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise _invalid("strict must be a boolean.", f"tools[{i}].strict")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        function["strict"] = tool.get("strict") is not False  # the Responses API's default: strict
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str) and set(choice) == {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise errors.unsupported("tool_choice", "tool_choice must be none, auto, required or {'type': 'function', "
                                            "'name': ...} here.")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if text is None:
        return None
    if text.get("verbosity") is not None:
        raise errors.unsupported("text.verbosity", "text.verbosity is not supported by this server.")
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        raise _invalid(f"Unrecognized field: text.{sorted(unknown)[0]}", f"text.{sorted(unknown)[0]}")
    fmt = text.get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise _invalid("text.format must be an object: {'type': 'text' | 'json_object' | 'json_schema', ...}.",
                       "text.format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return fmt  # json_object; anything else is chat's 400 on text.format


def _reasoning_effort(reasoning: dict[str, Any] | None) -> str | None:
    """`reasoning.effort`, for the chat templates that read it; the reasoning comes back whole, as
    `reasoning_text` content, whatever `reasoning.summary` asks (nothing is summarized)."""
    if reasoning is None:
        return None
    unknown = set(reasoning) - {"effort", "summary", "generate_summary"}
    if unknown:
        raise _invalid(f"Unrecognized field: reasoning.{sorted(unknown)[0]}", f"reasoning.{sorted(unknown)[0]}")
    return reasoning.get("effort")


# ---- the answer, as a response ---------------------------------------------------------------------


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str, status: str = "completed",
                  logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An assistant message; `logprobs` are chat's (the same shape as the Responses API's)."""
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def _reasoning_item(item_id: str, text: str, encrypted: bool = False) -> dict[str, Any]:
    """A reasoning item; `encrypted` (include `reasoning.encrypted_content`, which stateless clients ask for to
    send the item back): its text in base64, not encrypted, and not read back, as chat templates leave earlier
    reasoning out."""
    item = {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}
    if encrypted:
        item["encrypted_content"] = base64.b64encode(text.encode()).decode()
    return item


def _encrypted(body: ResponsesRequest) -> bool:
    return ENCRYPTED_REASONING in (body.include or ())


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def _response(body: ResponsesRequest, response_id: str, model: str, output: list[dict[str, Any]],
              finish_reason: str | None, usage: dict[str, Any] | None, status: str | None = None,
              error: dict[str, Any] | None = None, stored: bool = False) -> dict[str, Any]:
    reason = _INCOMPLETE.get(finish_reason or "")
    status = status or ("incomplete" if reason else "completed")
    return ResponseObject(
        id=response_id, created_at=now(), status=status, model=model, output=output, instructions=body.instructions,
        max_output_tokens=body.max_output_tokens, max_tool_calls=body.max_tool_calls, temperature=body.temperature,
        top_p=body.top_p,
        tools=body.tools or [], tool_choice=body.tool_choice or "auto",
        parallel_tool_calls=body.parallel_tool_calls is not False, text=body.text or {"format": {"type": "text"}},
        metadata=body.metadata or {}, user=body.user, error=error, store=stored, background=bool(body.background),
        truncation=body.truncation or "disabled",
        previous_response_id=body.previous_response_id,
        conversation=_conversation(body),
        incomplete_details={"reason": reason} if reason and status == "incomplete" else None,
        usage=None if usage is None else ResponseUsage(
            input_tokens=usage["prompt_tokens"],
            input_tokens_details={"cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                                  "cache_write_tokens": 0},  # nothing is billed for writing the prefix cache
            output_tokens=usage["completion_tokens"],
            output_tokens_details={"reasoning_tokens": 0},
            total_tokens=usage["total_tokens"],
        ),
    ).model_dump()


@dataclass
class _OpenItem:
    kind: str  # "reasoning", "message" or "call"
    item: dict[str, Any]  # as announced
    pieces: list[str] = field(default_factory=list)  # its text or arguments so far
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # a message's, so far


_JSON = msgspec.json.Encoder()


class ResponseEvents:
    """Chat's streamed chunks of one choice in, the Responses events out: an output item is opened on the
    first delta of its kind (reasoning, text, each call) and closed when another kind begins or the
    stream ends."""

    def __init__(self, body: ResponsesRequest, response_id: str, keep: _Keeper | None = None) -> None:
        self.body = body
        self.response_id = response_id
        self.keep = keep  # stores the finished response
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # the finished items
        self.open: _OpenItem | None = None  # the item being written
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.model: str | None = None  # from chat's first chunk
        self.failure: dict[str, Any] | None = None  # a failed run's `error`

    def _event(self, kind: str, **fields: Any) -> str:
        data = _JSON.encode({"type": kind, "sequence_number": self.sequence, **fields}).decode()
        self.sequence += 1
        return f"event: {kind}\ndata: {data}\n\n"

    async def events(self, chunks: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
        async with aclosing(chat_chunks(chunks)) as datas:  # a client gone: the chat run aborts
            async for data in datas:
                if self.model is None:  # chat's first chunk names the model served
                    self.model = data.get("model") or ""
                    snapshot = self._snapshot("in_progress")
                    yield self._event("response.created", response=snapshot)
                    yield self._event("response.in_progress", response=snapshot)
                if "error" in data:
                    error = data["error"]
                    self.failure = {"code": error.get("code") or "server_error", "message": error.get("message")}
                    for event in self.failed(self.failure, error.get("param")):
                        yield event
                    return
                for event in self._chunk(data):
                    yield event
        for event in self._close():
            yield event
        final = self._snapshot(None)
        if self.keep is not None:
            final = await self.keep(final)
        yield self._event("response.completed" if final["status"] == "completed" else "response.incomplete",
                          response=final)

    def failed(self, failure: dict[str, Any], param: str | None = None) -> list[str]:
        """The events that end a run that failed (`failure`: the response's `error`): the item being written
        closed, an `error`, and `response.failed`; after `response.created`, where the run failed before it."""
        opening = []
        if self.model is None:
            self.model = self.body.model or ""
            opening.append(self._event("response.created", response=self._snapshot("in_progress")))
        return [*opening, *self._close(),
                self._event("error", code=failure["code"], message=failure["message"], param=param),
                self._event("response.failed", response=self._snapshot("failed", failure))]

    def _snapshot(self, status: str | None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response so far (`status` None: as the finish reason makes it)."""
        return _response(self.body, self.response_id, self.model or "", self.output, self.finish_reason, self.usage,
                         status=status, error=error, stored=self.keep is not None and self.keep.stores)

    def _chunk(self, data: dict[str, Any]) -> list[str]:
        if data.get("usage"):
            self.usage = data["usage"]
        events: list[str] = []
        for choice in data.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._text_delta("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self._text_delta("message", delta["content"], (choice.get("logprobs") or {}).get("content"))
            for call in delta.get("tool_calls") or ():
                events += self._call_delta(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def _start(self, kind: str, item: dict[str, Any]) -> list[str]:
        events = self._close()
        self.open = _OpenItem(kind, item)
        events.append(self._event("response.output_item.added", output_index=len(self.output), item=item))
        if kind == "message":
            events.append(self._event("response.content_part.added", output_index=len(self.output), item_id=item["id"],
                                      content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def _text_delta(self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[str]:
        events: list[str] = []
        if self.open is None or self.open.kind != kind:
            prefix = "msg" if kind == "message" else "rs"
            item = {"type": "message", "id": _item_id(prefix), "status": "in_progress", "role": "assistant",
                    "content": []} if kind == "message" else {"type": "reasoning", "id": _item_id(prefix), "summary": []}
            events = self._start(kind, item)
        self.open.pieces.append(text)
        self.open.logprobs += logprobs or ()
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": logprobs or []} if kind == "message" else {}
        events.append(self._event(name, output_index=len(self.output), item_id=self.open.item["id"],
                                  content_index=0, delta=text, **extra))
        return events

    def _call_delta(self, call: dict[str, Any]) -> list[str]:
        events: list[str] = []
        function = call.get("function") or {}
        if "id" in call:  # a new call: its id and name come first
            item = _call_item(_item_id("fc"), call["id"], function.get("name", ""), "", status="in_progress")
            events = self._start("call", item)
        arguments = function.get("arguments")
        if arguments and self.open is not None and self.open.kind == "call":
            self.open.pieces.append(arguments)
            events.append(self._event("response.function_call_arguments.delta", output_index=len(self.output),
                                      item_id=self.open.item["id"], delta=arguments))
        return events

    def _close(self) -> list[str]:
        """The done events of the item being written, which joins the output."""
        if self.open is None:
            return []
        kind, item, text, index = self.open.kind, self.open.item, "".join(self.open.pieces), len(self.output)
        logprobs = self.open.logprobs
        self.open = None
        events = []
        if kind == "message":
            done = _message_item(item["id"], text, logprobs=logprobs)
            events.append(self._event("response.output_text.done", output_index=index, item_id=item["id"],
                                      content_index=0, text=text, logprobs=logprobs))
            events.append(self._event("response.content_part.done", output_index=index, item_id=item["id"],
                                      content_index=0, part=done["content"][0]))
        elif kind == "reasoning":
            done = _reasoning_item(item["id"], text, _encrypted(self.body))
            events.append(self._event("response.reasoning_text.done", output_index=index, item_id=item["id"],
                                      content_index=0, text=text))
        else:
            done = _call_item(item["id"], item["call_id"], item["name"], text)
            events.append(self._event("response.function_call_arguments.done", output_index=index,
                                      item_id=item["id"], name=item["name"], arguments=text))
        events.append(self._event("response.output_item.done", output_index=index, item=done))
        self.output.append(done)
        return events
