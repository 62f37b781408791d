"""What the APIs run as chat completions share (OpenAI's Responses API, responses_api.py; Anthropic's Messages API,
anthropic_api.py): the chat endpoint they call, the chat request validated and its errors, a non-streamed
completion read whole, chat's error answers, and chat's streamed chunks, each with its `param` named as the
caller's own request names it; and the /tokenize body that counts a chat request's prompt."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import msgspec
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from llmserve.errors import InvalidRequestError
from llmserve.server import errors
from llmserve.server.protocol import ChatCompletionRequest

# The caller's chat endpoint: the chat request, validated and as JSON, in; its response out.
RunChat = Callable[[ChatCompletionRequest, dict[str, Any]], Awaitable[Response]]
Rename = Callable[[str | None], str | None]
_T = TypeVar("_T")


def renamer(names: Mapping[str, str], messages: str) -> Rename:
    """Chat's parameter path -> the caller's: its first name by `names`, and chat's messages as `messages` (they do
    not line up with the caller's one to one)."""
    def rename(param: str | None) -> str | None:
        if param is None:
            return None
        head, dot, rest = param.partition(".")
        head, bracket, index = head.partition("[")
        if head == "messages":
            return messages
        return names.get(head, head) + (bracket + index if bracket else "") + dot + rest

    return rename


def chat_request(payload: dict[str, Any], rename: Rename, default_param: str) -> ChatCompletionRequest:
    """The chat request of `payload`; a 400 naming the caller's field when it is not one."""
    try:
        return ChatCompletionRequest.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = rename(errors.param_path(first.get("loc", ())))
        raise InvalidRequestError(f"Invalid value for '{param}': {first.get('msg', 'invalid value')}",
                                  param=param or default_param) from None


async def renamed(call: Awaitable[_T], rename: Rename) -> _T:
    """`call`'s result; its errors' `param` named as the caller's request names it."""
    try:
        return await call
    except (errors.APIError, InvalidRequestError) as exc:
        exc.param = rename(exc.param)
        raise


def error_reply(reply: Response, rename: Rename) -> Response:
    """Chat's error answer, with its `param` named as the caller's request names it."""
    try:
        body = json.loads(bytes(reply.body))
        body["error"]["param"] = rename(body["error"].get("param"))
    except (AttributeError, ValueError, TypeError, KeyError):  # not OpenAI's error shape: passed on as it is
        return reply
    kept = {k: v for k, v in reply.headers.items() if k not in ("content-length", "content-type")}  # Retry-After
    return JSONResponse(body, status_code=reply.status_code, headers=kept)


async def whole_completion(reply: Response) -> dict[str, Any]:
    """A non-streamed chat completion's JSON. Asked for progress events (the header a gateway sends), chat
    answers with them instead, the completion last: read to it."""
    if not isinstance(reply, StreamingResponse):
        return json.loads(bytes(reply.body))
    last = ""
    async for raw in reply.body_iterator:
        for line in (raw if isinstance(raw, str) else raw.decode()).splitlines():
            last = line[6:] if line.startswith("data: {") else last
    completion = json.loads(last)
    if "choices" not in completion:  # the engine failed on the way: its error event
        error = completion.get("error") or {}
        raise errors.APIError(500, error.get("message") or "The request failed.", code=error.get("code"))
    return completion


async def chat_chunks(events: AsyncIterator[str | bytes]) -> AsyncIterator[dict[str, Any]]:
    """Chat's streamed events as JSON, each chunk (or error) once; closing this closes `events`, which ends the chat
    run (a client gone). Use it under `contextlib.aclosing`."""
    pending = ""
    try:
        async for raw in events:
            pending += raw if isinstance(raw, str) else raw.decode()
            *lines, pending = pending.split("\n")
            for line in lines:
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield msgspec.json.decode(line[6:])
    finally:
        close = getattr(events, "aclose", None)
        if close is not None:
            await close()


def chat_tokenize_body(model: str | None, payload: Mapping[str, Any]) -> dict[str, Any]:
    """The /tokenize body of a chat request's prompt, as the chat endpoint renders it: the tools' schemas, the
    template's variables (`reasoning_effort` among them, as chat passes it) and the image processor's options too."""
    body = {"model": model, "messages": payload["messages"],
            "add_generation_prompt": payload.get("add_generation_prompt", True),
            "continue_final_message": payload.get("continue_final_message", False)}
    if payload.get("tools"):
        body["tools"] = payload["tools"]
    for name in ("mm_processor_kwargs", "documents", "chat_template"):
        if payload.get(name) is not None:
            body[name] = payload[name]
    variables = dict(payload.get("chat_template_kwargs") or {})
    if payload.get("reasoning_effort") is not None:
        variables.setdefault("reasoning_effort", payload["reasoning_effort"])
    if variables:
        body["chat_template_kwargs"] = variables
    return body
