"""OpenAI's Responses API as a chat completion: `answer` translates a request (`responses_protocol` holds its
shapes).

A request is translated into a chat completion (its `input` items into messages, `instructions` into the
first system message, its flat function tools into chat's, `text.format` into `response_format`), run by
the caller's chat endpoint (the server's, or a gateway platform's: so keys, limits, metering, safety,
disconnects and the tool and reasoning parsers are chat's), and its answer translated back (`responses_output`):
output items (`reasoning`, `message`, `function_call`) and the Responses usage; streamed, chat's chunks become the
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
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import Request
from starlette.types import Message

from llmserve.errors import InvalidRequestError
from llmserve.platform.conversations import ConversationStore
from llmserve.platform.responses import ResponseChainBroken, ResponseNotFound, ResponseStore, with_ids
from llmserve.server import errors
from llmserve.server.chat_translation import (
    RunChat,
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
from llmserve.server.protocol import ChatCompletionRequest, ChatMessage
from llmserve.server.responses_output import ResponseEvents, completed_output, response_object
from llmserve.server.responses_protocol import (
    LOGPROBS,
    InputTokensRequest,
    ResponsesRequest,
    conversation_ref,
)
from llmserve.server.streaming import STREAM_ID_HEADER, EventIds, StreamRegistry, event_stream

logger = logging.getLogger(__name__)

# Chat's parameter names in errors -> the Responses request's own.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
           "conversation_id": "conversation"}
_rename = renamer(_PARAMS, "input")
# Known Responses fields this server does not implement (each would change the output).
_UNSUPPORTED = ("prompt",)


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
    answer_json = response_object(body, response_id, completion["model"], completed_output(body, completion),
                                  completion["choices"][0]["finish_reason"], completion["usage"], stored=keep.stores)
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
    queued = response_object(body, response_id, body.model or "", [], None, None, status="queued", stored=True)
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



def _conversation_id(body: ResponsesRequest, storage: Storage | None) -> str | None:
    """The id of the stored conversation the request continues, if it names one."""
    conversation = conversation_ref(body)
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


