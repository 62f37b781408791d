"""Anthropic's Messages API (POST /v1/messages) as a chat completion, as vLLM serves it: the request's shapes, and
`answer`, which translates one; and the chat prompt whose tokens /v1/messages/count_tokens counts.

A request becomes a chat completion (`system` the first system message; each message's content blocks: text,
`tool_use` blocks an assistant turn's tool calls, `tool_result` blocks tool messages; earlier `thinking` blocks are
left out, as chat templates leave reasoning out; tools chat's function tools, strict so that a `tool_use` block's
`input` is always an object; `thinking` the template's thinking switch and chat's `thinking_token_budget`), run by
the caller's chat endpoint (the server's, or a gateway platform's: so keys, limits, metering, safety, disconnects
and the tool and reasoning parsers are chat's), and its answer translated back: content blocks (`thinking` from the
reasoning parser, `text`, `tool_use`), `stop_reason` and Anthropic's usage (`input_tokens` leaves out the prompt
tokens read from the prefix cache, `cache_read_input_tokens`).
Streamed, chat's chunks become Anthropic's events (message_start, content_block_start / _delta / _stop,
message_delta, message_stop). Stop sequences are asked of chat with their text kept, and taken off the end here, so
that `stop_sequence` can say which one ended the reply; streamed, text that could be the start of one is held back
until the reply shows it is not. Errors name the `param` as this request names it; `anthropic_errors` answers them
in Anthropic's shape."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Literal

import msgspec
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, StrictBool

from llmserve.errors import InvalidRequestError
from llmserve.server import errors
from llmserve.server.chat_translation import (
    RunChat,
    chat_chunks,
    chat_request,
    error_reply,
    renamed,
    renamer,
    whole_completion,
)
from llmserve.server.openapi import documented
from llmserve.server.protocol import ChatCompletionRequest, Int64, RequestBody

# Chat's parameter names in errors -> the Messages request's own.
_PARAMS = {"stop": "stop_sequences", "user": "metadata.user_id", "max_completion_tokens": "max_tokens",
           "parallel_tool_calls": "tool_choice.disable_parallel_tool_use", "response_format": "output_config.format",
           "reasoning_effort": "output_config.effort", "thinking_token_budget": "thinking.budget_tokens",
           "chat_template_kwargs": "thinking"}
_rename = renamer(_PARAMS, "messages")
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}
_IGNORED_BLOCK_FIELDS = frozenset({"cache_control", "citations"})  # prompt-caching hints: every prompt is cached


class MessagesRequest(RequestBody):
    """Anthropic's Messages API request."""

    model: str
    max_tokens: Int64 = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: StrictBool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: Int64 | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # `format` (a JSON schema the reply follows) and `effort`
    service_tier: str | None = None  # accepted without effect, as chat's
    cache_control: dict[str, Any] | None = None  # a prompt-caching hint: every prompt is cached anyway


class CountTokensRequest(RequestBody):
    """Anthropic's /v1/messages/count_tokens request: the prompt part of a Messages request."""

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int


class MessageObject(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage


class TokenCount(BaseModel):
    input_tokens: int


DOCUMENTED = documented(MessageObject, stream=True)


async def answer(body: MessagesRequest, run_chat: RunChat) -> Response:
    """The message answering `body`, by way of a chat completion that `run_chat` runs."""
    chat, payload = _chat_request(body)
    reply = await renamed(run_chat(chat, payload), _rename)
    headers = {k: v for k, v in reply.headers.items() if k.startswith("x-")}
    if reply.status_code != 200:  # an error answered rather than raised (a gateway's replica's)
        return error_reply(reply, _rename)
    message_id = f"msg_{uuid.uuid4().hex}"
    stops = body.stop_sequences or []
    if body.stream:
        assert isinstance(reply, StreamingResponse)
        events = MessageEvents(message_id, stops).events(reply.body_iterator)
        return StreamingResponse(events, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
    completion = await whole_completion(reply)
    choice = completion["choices"][0]
    message = choice["message"]
    text, stop_sequence = _without_stop(message.get("content") or "", stops, choice["finish_reason"])
    content = []
    if message.get("reasoning_content"):
        content.append(_thinking_block(message["reasoning_content"]))
    if text:
        content.append({"type": "text", "text": text})
    content += [_tool_use_block(call["id"], call["function"]["name"], call["function"]["arguments"])
                for call in message.get("tool_calls") or ()]
    return JSONResponse(_message(message_id, completion["model"], content, choice["finish_reason"], stop_sequence,
                                 completion["usage"]), headers=headers)


def count_request(body: CountTokensRequest) -> dict[str, Any]:
    """The /tokenize body whose count is the request's input tokens: its conversation as chat templates it."""
    fields = {"model": body.model, "messages": _messages(body.system, body.messages),
              "tools": _tools(body.tools), "add_generation_prompt": True}
    fields["chat_template_kwargs"] = _thinking(body.thinking).get("chat_template_kwargs")
    _output_config(body.output_config)
    if body.tool_choice is not None:
        _tool_choice(body.tool_choice)
    return {k: v for k, v in fields.items() if v is not None}


# ---- the request, as a chat completion -----------------------------------------------------------------------


def _chat_request(body: MessagesRequest) -> tuple[ChatCompletionRequest, dict[str, Any]]:
    choice, parallel = _tool_choice(body.tool_choice)
    response_format, effort = _output_config(body.output_config)
    user = (body.metadata or {}).get("user_id")
    if user is not None and not isinstance(user, str):
        raise _invalid("metadata.user_id must be a string.", "metadata.user_id")
    fields: dict[str, Any] = {
        "model": body.model, "messages": _messages(body.system, body.messages), "stream": body.stream,
        "max_tokens": body.max_tokens, "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
        "stop": body.stop_sequences or None, "include_stop_str_in_output": bool(body.stop_sequences) or None,
        "tools": _tools(body.tools), "tool_choice": choice, "parallel_tool_calls": parallel, "user": user,
        "service_tier": body.service_tier, "response_format": response_format, "reasoning_effort": effort,
        **_thinking(body.thinking),
    }
    if body.stream:
        fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    payload = {k: v for k, v in fields.items() if v is not None}
    return chat_request(payload, _rename, "messages"), payload


def _thinking(thinking: dict[str, Any] | None) -> dict[str, Any]:
    """Extended thinking as chat's fields: "enabled" turns the template's thinking on (Qwen3's `enable_thinking`)
    and caps it at `budget_tokens` (chat's `thinking_token_budget`), "adaptive" turns it on uncapped, "disabled"
    turns it off; left out, the template's default holds."""
    if thinking is None:
        return {}
    kind = thinking.get("type")
    known = {"enabled": {"type", "budget_tokens"}, "adaptive": {"type"}, "disabled": {"type"}}
    if kind not in known:
        raise _invalid("thinking.type must be 'enabled', 'adaptive' or 'disabled'.", "thinking.type")
    unknown = sorted(set(thinking) - known[kind])
    if unknown:
        raise _invalid(f"Unrecognized thinking field for type {kind!r}: {unknown[0]}", f"thinking.{unknown[0]}")
    fields: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": kind != "disabled"}}
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise _invalid("thinking.budget_tokens must be a non-negative integer.", "thinking.budget_tokens")
        fields["thinking_token_budget"] = budget
    return fields


def _output_config(config: dict[str, Any] | None) -> tuple[dict[str, Any] | None, str | None]:
    """Chat's response_format (a JSON schema the reply follows) and reasoning_effort (the chat template's variable)."""
    if config is None:
        return None, None
    unknown = set(config) - {"format", "effort"}
    if unknown:
        raise _invalid(f"Unrecognized output_config field: {sorted(unknown)[0]}", f"output_config.{sorted(unknown)[0]}")
    shape = config.get("format")
    response_format = None
    if shape is not None:
        if not isinstance(shape, dict) or shape.get("type") != "json_schema" or not isinstance(shape.get("schema"), dict):
            raise _invalid("output_config.format must be {'type': 'json_schema', 'schema': {...}}.",
                           "output_config.format")
        response_format = {"type": "json_schema", "json_schema": {"name": "output", "schema": shape["schema"],
                                                                  "strict": True}}
    return response_format, config.get("effort")


def _messages(system: str | list[dict[str, Any]] | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = []
    if system:
        chat.append({"role": "system", "content": _text(system, "system")})
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        role = message.get("role")
        unknown = set(message) - {"role", "content"}
        if unknown:
            raise _invalid(f"Unrecognized message field: {sorted(unknown)[0]}", f"{param}.{sorted(unknown)[0]}")
        if role == "user":
            chat += _user_turn(message.get("content"), f"{param}.content")
        elif role == "assistant":
            chat.append(_assistant_turn(message.get("content"), f"{param}.content"))
        else:
            raise _invalid(f"{param}.role must be user or assistant.", f"{param}.role")
    return chat


def _blocks(content: Any, param: str) -> list[dict[str, Any]]:
    """A message's content as blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(block, dict) for block in content):
        raise _invalid(f"{param} must be a string or a list of content blocks.", param)
    return content


def _text(content: Any, param: str) -> str:
    """Text blocks (or a string) as one text."""
    texts = []
    for j, block in enumerate(_blocks(content, param)):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise errors.unsupported(f"{param}[{j}]", f"Content blocks of type {block.get('type')!r} are not "
                                                      "supported here (only text).")
        _check_block_fields(block, {"type", "text"}, f"{param}[{j}]")
        texts.append(block["text"])
    return "".join(texts)


def _user_turn(content: Any, param: str) -> list[dict[str, Any]]:
    """A user message: its tool results as tool messages, then its text and images as a user message."""
    turn: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(_blocks(content, param)):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            _check_block_fields(block, {"type", "text"}, f"{param}[{j}]")
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            _check_block_fields(block, {"type", "source"}, f"{param}[{j}]")
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.get("source"), f"{param}[{j}]")}})
        elif kind == "tool_result":
            _check_block_fields(block, {"type", "tool_use_id", "content", "is_error"}, f"{param}[{j}]")
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise _invalid(f"{param}[{j}].tool_use_id is required (a string).", f"{param}[{j}].tool_use_id")
            result = block.get("content", "")
            turn.append({"role": "tool", "tool_call_id": call_id,
                         "content": _text(result, f"{param}[{j}].content") if result else ""})
        else:
            raise errors.unsupported(f"{param}[{j}]", f"Content blocks of type {kind!r} are not supported in a "
                                                      "user message here (text, image and tool_result).")
    if any(part["type"] == "image_url" for part in parts):
        turn.append({"role": "user", "content": parts})
    elif parts:
        turn.append({"role": "user", "content": "".join(part["text"] for part in parts)})
    return turn


def _image_url(source: Any, param: str) -> str:
    """An image block's source as chat's image URL: base64 data as a data: URL, or the URL."""
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str) \
            and isinstance(source.get("media_type"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise _invalid("An image's source must be {'type': 'base64', 'media_type': ..., 'data': ...} or "
                   "{'type': 'url', 'url': ...}.", f"{param}.source")


def _assistant_turn(content: Any, param: str) -> dict[str, Any]:
    """An assistant message: its text, and its tool_use blocks as tool calls (thinking is left out)."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(_blocks(content, param)):
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            name, call_id, arguments = block.get("name"), block.get("id"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(arguments, dict):
                raise _invalid(f"{param}[{j}] must have an id and a name (strings) and an input (an object).",
                               f"{param}[{j}]")
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(arguments)}})
        elif kind not in ("thinking", "redacted_thinking"):
            raise errors.unsupported(f"{param}[{j}]", f"Content blocks of type {kind!r} are not supported in an "
                                                      "assistant message here (text, tool_use, thinking).")
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _check_block_fields(block: dict[str, Any], known: set[str], param: str) -> None:
    unknown = set(block) - known - _IGNORED_BLOCK_FIELDS
    if unknown:
        raise _invalid(f"Unrecognized content block field: {sorted(unknown)[0]}", f"{param}.{sorted(unknown)[0]}")


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    converted = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            raise errors.unsupported(f"tools[{i}].type", f"Tools of type {tool.get('type')!r} are not supported "
                                                         "here: only client tools (name, input_schema).")
        unknown = set(tool) - {"type", "name", "description", "input_schema", "strict", "cache_control"}
        if unknown:
            raise _invalid(f"Unrecognized tool field: {sorted(unknown)[0]}", f"tools[{i}].{sorted(unknown)[0]}")
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise _invalid("strict must be a boolean.", f"tools[{i}].strict")
        function = {"name": tool.get("name"), "parameters": tool.get("input_schema"),
                    "strict": tool.get("strict") is not False}  # a tool_use block's input must be an object
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        converted.append({"type": "function", "function": function})
    return converted


def _tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool | None]:
    """Chat's tool_choice and parallel_tool_calls."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    unknown = set(choice) - {"type", "name", "disable_parallel_tool_use"}
    disable = choice.get("disable_parallel_tool_use")
    if unknown or kind not in ("auto", "any", "tool", "none") or not isinstance(disable, bool | None):
        raise _invalid("tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}, with "
                       "an optional disable_parallel_tool_use.", "tool_choice")
    parallel = None if disable is None else not disable
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _invalid("tool_choice.name is required (a string) for type 'tool'.", "tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


# ---- the answer ------------------------------------------------------------------------------------------------


def _without_stop(text: str, stops: list[str], finish_reason: str | None) -> tuple[str, str | None]:
    """The text without the stop sequence that ended it (kept by chat, so that it could be told apart from the end
    of the turn), and that sequence."""
    if finish_reason == "stop":
        for stop in stops:
            if text.endswith(stop):
                return text[: len(text) - len(stop)], stop
    return text, None


def _thinking_block(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}


def _tool_use_block(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    try:
        given = json.loads(arguments) if arguments else {}
    except ValueError:
        given = None
    return {"type": "tool_use", "id": call_id, "name": name,
            "input": given if isinstance(given, dict) else {"arguments": arguments}}


def _usage(usage: dict[str, Any] | None) -> dict[str, int]:
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": (usage.get("prompt_tokens") or 0) - cached, "output_tokens": usage.get("completion_tokens")
            or 0, "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _stop_reason(finish_reason: str | None, stop_sequence: str | None, called: bool) -> str | None:
    """Anthropic's stop reason: a tool call's turn ends in "tool_use" (chat's is "stop" for a named tool)."""
    if stop_sequence is not None:
        return "stop_sequence"
    if finish_reason is None:
        return None
    return "tool_use" if called and finish_reason == "stop" else _STOP_REASONS.get(finish_reason, "end_turn")


def _message(message_id: str, model: str, content: list[dict[str, Any]], finish_reason: str | None,
             stop_sequence: str | None, usage: dict[str, Any] | None) -> dict[str, Any]:
    called = any(block["type"] == "tool_use" for block in content)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": _stop_reason(finish_reason, stop_sequence, called), "stop_sequence": stop_sequence,
            "usage": _usage(usage)}


def _invalid(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


# ---- streamed ------------------------------------------------------------------------------------------------

_JSON = msgspec.json.Encoder()


class MessageEvents:
    """Chat's streamed chunks in, Anthropic's events out: a content block is opened on the first delta of its kind
    (thinking, text, each tool call) and closed when another begins or the stream ends. Text that could be the
    start of a stop sequence is held back until the next text (or the end) shows whether it is."""

    def __init__(self, message_id: str, stops: list[str]) -> None:
        self.message_id = message_id
        self.stops = stops
        self.holdback = max((len(stop) for stop in stops), default=1) - 1
        self.held = ""  # text not sent yet: it may end in a stop sequence
        self.index = -1  # the open block's index
        self.open: str | None = None  # its kind: "thinking", "text" or "tool_use"
        self.model = ""
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.called = False  # a tool_use block was sent

    @staticmethod
    def _event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {_JSON.encode({'type': kind, **fields}).decode()}\n\n"

    async def events(self, chunks: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
        started = False
        async with aclosing(chat_chunks(chunks)) as datas:  # a client gone: the chat run aborts
            async for data in datas:
                if "error" in data:
                    error = data["error"]
                    yield self._event("error", error={"type": "api_error", "message": error.get("message")})
                    return
                self.usage = data.get("usage") or self.usage
                if not started:
                    started = True
                    self.model = data.get("model") or ""
                    message = _message(self.message_id, self.model, [], None, None, self.usage)
                    yield self._event("message_start", message=message)
                for event in self._chunk(data):
                    yield event
        text, stop_sequence = _without_stop(self.held, self.stops, self.finish_reason)
        for event in [*(self._text(text) if text else []), *self._close()]:
            yield event
        usage = _usage(self.usage)
        stop_reason = _stop_reason(self.finish_reason, stop_sequence, self.called)
        yield self._event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                          usage=usage)
        yield self._event("message_stop")

    def _chunk(self, data: dict[str, Any]) -> list[str]:
        events: list[str] = []
        for choice in data.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self._flush()
                events += self._delta("thinking", {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
            if delta.get("content"):
                self.held += delta["content"]
                cut = len(self.held) - self.holdback
                if cut > 0:
                    events += self._text(self.held[:cut])
                    self.held = self.held[cut:]
            for call in delta.get("tool_calls") or ():
                events += self._call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def _flush(self) -> list[str]:
        """The text held back, sent: what follows it is no text, so it ends in no stop sequence."""
        held, self.held = self.held, ""
        return self._text(held) if held else []

    def _text(self, text: str) -> list[str]:
        return self._delta("text", {"type": "text_delta", "text": text})

    def _delta(self, kind: str, delta: dict[str, Any]) -> list[str]:
        events = []
        if self.open != kind:
            block = {"type": kind, kind: ""}
            if kind == "thinking":
                block["signature"] = ""
            events = self._start(kind, block)
        events.append(self._event("content_block_delta", index=self.index, delta=delta))
        return events

    def _call(self, call: dict[str, Any]) -> list[str]:
        events: list[str] = []
        function = call.get("function") or {}
        if "id" in call:  # a new call: its id and name come first
            events += self._flush()
            self.called = True
            events += self._start("tool_use", {"type": "tool_use", "id": call["id"], "name": function.get("name", ""),
                                               "input": {}})
        arguments = function.get("arguments")
        if arguments and self.open == "tool_use":
            events.append(self._event("content_block_delta", index=self.index,
                                      delta={"type": "input_json_delta", "partial_json": arguments}))
        return events

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self._close()
        self.index += 1
        self.open = kind
        events.append(self._event("content_block_start", index=self.index, content_block=block))
        return events

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            events.append(self._event("content_block_delta", index=self.index,
                                      delta={"type": "signature_delta", "signature": ""}))
        self.open = None
        events.append(self._event("content_block_stop", index=self.index))
        return events
