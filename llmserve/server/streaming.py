"""Plumbing between engine streams and HTTP: server-sent events, client-disconnect detection, and
several request streams merged into one (a /v1/completions prompt list)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.platform.safety import OutputGuard, Verdict
from llmserve.server.errors import ClientDisconnected

if TYPE_CHECKING:  # the gateway uses this module without an engine (nor torch)
    from llmserve.engine.async_llm import RequestStream

T = TypeVar("T")

CONTENT_FILTER = "content_filter"

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | str) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


class ChunkEnvelope:
    """What every chunk of one streamed response repeats (id, object, created, model, ...), serialized
    once from the response model with no choices and no usage; `event` puts choices in it, giving
    `sse(response)`'s bytes at a fraction of the cost (a chunk per token per stream adds up)."""

    def __init__(self, empty: BaseModel) -> None:
        head, marker, tail = empty.model_dump_json().partition('"choices":[]')
        if not marker:
            raise ValueError("the envelope needs a response whose choices are empty")
        self._head = f'data: {head}"choices":['
        self._tail = f"]{tail}\n\n"
        self._usage_head, marker, self._usage_tail = self._tail.partition('"usage":null')
        if not marker:
            raise ValueError("the envelope needs a response whose usage is null")

    def event(self, choices: Iterable[BaseModel | str], usage: BaseModel | None = None) -> str:
        """An SSE event of the choices (models, or their JSON from `text_choice_json`/`content_choice_json`),
        with `usage` in it when given (`stream_options.continuous_usage_stats`)."""
        joined = ",".join(c if isinstance(c, str) else c.model_dump_json() for c in choices)
        if usage is None:
            return self._head + joined + self._tail
        return f'{self._head}{joined}{self._usage_head}"usage":{usage.model_dump_json()}{self._usage_tail}'


def text_choice_json(index: int, text: str, finish_reason: str | None) -> str:
    """A completion chunk's choice without logprobs: `CompletionChoice(...).model_dump_json()`, faster."""
    return f'{{"index":{index},"text":{_json_string(text)},"logprobs":null,"finish_reason":{_json_or_null(finish_reason)}}}'


def content_choice_json(index: int, content: str, finish_reason: str | None) -> str:
    """A chat chunk's choice without logprobs (`{}` as the delta when there is no content)."""
    delta = f'{{"content":{_json_string(content)}}}' if content else "{}"
    return f'{{"index":{index},"delta":{delta},"logprobs":null,"finish_reason":{_json_or_null(finish_reason)}}}'


def _json_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # pydantic's JSON: non-ASCII as UTF-8, controls escaped


def _json_or_null(value: str | None) -> str:
    return "null" if value is None else _json_string(value)


def event_stream(events: AsyncIterator[str], headers: dict[str, str] | None = None) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read already, so the next message is the disconnect (or the response end).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its engine requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientDisconnected()


Observer = Callable[[int, RequestOutput], None]


def _ignore(position: int, output: RequestOutput) -> None:
    pass


async def final_output(stream: RequestStream, observe: Observer = _ignore, position: int = 0) -> RequestOutput:
    """Run a request to its end and return its last output (abort it if interrupted); `observe` sees
    every output on the way (the usage meter counts what was generated even if the client leaves)."""
    last: RequestOutput | None = None
    try:
        async for output in stream:
            observe(position, output)
            last = output
    finally:
        stream.abort()
    assert last is not None and last.finished
    return last


async def final_outputs(streams: Sequence[RequestStream], observe: Observer = _ignore) -> list[RequestOutput]:
    try:
        return list(await asyncio.gather(*(final_output(s, observe, i) for i, s in enumerate(streams))))
    finally:
        for stream in streams:
            stream.abort()


_END = object()


async def merged(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    inbox: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(position: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                inbox.put_nowait((position, output))
            inbox.put_nowait((position, _END))
        except Exception as exc:
            inbox.put_nowait((position, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            position, item = await inbox.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                assert isinstance(item, RequestOutput)
                yield position, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()


@dataclass
class Delta:
    """What one choice gained since it was last streamed."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


class StreamCursor:
    """How much of one choice has been streamed; turns its cumulative output into the next delta.

    With a safety `guard`, only the text the guard releases is sent (it holds back a window of
    characters until they are checked); once it blocks, the choice ends with finish_reason
    "content_filter" and nothing after the last released character is ever sent."""

    def __init__(self, guard: OutputGuard | None = None) -> None:
        self.text_sent = 0
        self.tokens_sent = 0
        self.done = False
        self.guard = guard
        self.blocked: Verdict | None = None

    def visible(self, completion: CompletionOutput) -> tuple[str, str | None]:
        """The text that may be shown so far and the finish reason (content_filter once blocked)."""
        finish_reason = completion.finish_reason
        if self.guard is None:
            return completion.text, finish_reason
        step = self.guard.feed(completion.text, finished=finish_reason is not None)
        if step.blocked:
            self.blocked = step.verdict
            return self.guard.released_text, CONTENT_FILTER
        return self.guard.released_text, finish_reason

    def advance(self, completion: CompletionOutput) -> Delta | None:
        """The new part of `completion`, or None when there is nothing to send yet (held-back text
        keeps its tokens for the next delta) or the choice already finished."""
        if self.done:
            return None
        text, finish_reason = self.visible(completion)
        new_text = text[self.text_sent :]
        finished = finish_reason is not None
        if not new_text and not finished:
            return None
        start = self.tokens_sent
        logprobs = completion.logprobs[start:] if completion.logprobs is not None else None
        self.text_sent = max(self.text_sent, len(text))
        self.tokens_sent = len(completion.token_ids)
        self.done = finished
        return Delta(new_text, completion.token_ids[start:], logprobs, finish_reason)
