"""A Responses API answer from a chat completion's: output items (`reasoning`, `message`, `function_call`) and the
Responses usage, whole (`completed_output`, `response_object`) or streamed (`ResponseEvents`: chat's chunks in, the
Responses events out, each numbered by `sequence_number`)."""

from __future__ import annotations

import base64
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from llmserve.server.chat_translation import chat_chunks
from llmserve.server.protocol import now
from llmserve.server.responses_protocol import (
    ENCRYPTED_REASONING,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    conversation_ref,
)


class Keep(Protocol):
    """What keeps a finished response (stores it, appends its turn): the response as answered."""

    @property
    def stores(self) -> bool: ...

    async def __call__(self, response: dict[str, Any]) -> dict[str, Any]: ...


def completed_output(body: ResponsesRequest, completion: dict[str, Any]) -> list[dict[str, Any]]:
    """A whole chat completion's first choice as output items: its reasoning, its text, its function calls."""
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
    return output


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


def response_object(body: ResponsesRequest, response_id: str, model: str, output: list[dict[str, Any]],
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
        conversation=conversation_ref(body),
        incomplete_details={"reason": reason} if reason and status == "incomplete" else None,
        usage=None if usage is None else ResponseUsage(
            input_tokens=usage["prompt_tokens"],
            input_tokens_details={"cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                                  "cache_write_tokens": 0},  # nothing is billed for writing the prefix cache
            output_tokens=usage["completion_tokens"],
            output_tokens_details={"reasoning_tokens": (usage.get("completion_tokens_details") or {}).get(
                "reasoning_tokens", 0)},
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

    def __init__(self, body: ResponsesRequest, response_id: str, keep: Keep | None = None) -> None:
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
        return response_object(self.body, self.response_id, self.model or "", self.output, self.finish_reason, self.usage,
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
