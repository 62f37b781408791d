"""Plumbing between engine streams and HTTP: server-sent events (numbered, and buffered for resuming
when asked: see server/streams.py), client-disconnect detection, and several request streams merged
into one (a /v1/completions prompt list)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import os
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.platform.safety import OutputGuard, Verdict
from llmserve.server.errors import APIError, ClientDisconnected

logger = logging.getLogger(__name__)

if TYPE_CHECKING:  # the gateway uses this module without an engine (nor torch)
    from llmserve.engine.async_llm import RequestStream

T = TypeVar("T")

CONTENT_FILTER = "content_filter"

SSE_DONE = "data: [DONE]\n\n"

STREAM_ID_HEADER = "x-stream-id"  # a resumable stream's id (its response id)
# Asks for a non-streamed response as usage progress events, then the response as one event (a gateway
# meters a request whose client left with the usage the replica reported last, server/pipeline.py).
PROGRESS_HEADER = "x-llmserve-usage-progress"


def sse(payload: BaseModel | str) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


# With OpenAI's `stream_options.include_obfuscation`, a chunk's event is padded to a multiple of this many
# bytes, so that its size no longer tells how long its text is (a token-length side channel).
OBFUSCATION_BLOCK = 64


def obfuscated(event: str) -> str:
    """An SSE event of one JSON object (`data: {...}\n\n`) with an `obfuscation` field of random
    characters (at least one) that brings its size to a multiple of OBFUSCATION_BLOCK bytes."""
    body = event[:-3]  # without the closing "}\n\n"
    size = len(body.encode()) + len(',"obfuscation":""}\n\n')
    pad = -size % OBFUSCATION_BLOCK or OBFUSCATION_BLOCK  # never empty, as OpenAI's
    noise = base64.urlsafe_b64encode(os.urandom(pad)).decode()[:pad]
    return f'{body},"obfuscation":"{noise}"}}\n\n'


class ChunkEnvelope:
    """What every chunk of one streamed response repeats (id, object, created, model, ...), serialized
    once from the response model with no choices and no usage; `event` puts choices in it, giving
    `sse(response)`'s bytes at a fraction of the cost (a chunk per token per stream adds up).
    `obfuscate`: each event padded (`obfuscated`)."""

    def __init__(self, empty: BaseModel, obfuscate: bool = False) -> None:
        self._obfuscate = obfuscate
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
            event = self._head + joined + self._tail
        else:
            event = f'{self._head}{joined}{self._usage_head}"usage":{usage.model_dump_json()}{self._usage_tail}'
        return obfuscated(event) if self._obfuscate else event


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
    "content_filter" and nothing after the last released character is ever sent, nor any token (a
    logprob) whose text goes past it."""

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

    def seen(self, completion: CompletionOutput) -> tuple[str, str | None]:
        """Once the choice was streamed to its end: the text its client saw, and the finish reason it was told."""
        if self.guard is None:
            return completion.text, completion.finish_reason
        return self.guard.released_text, CONTENT_FILTER if self.blocked is not None else completion.finish_reason

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
        end = max(start, self._shown_tokens(completion, len(text)))
        logprobs = completion.logprobs[start:end] if completion.logprobs is not None else None
        self.text_sent = max(self.text_sent, len(text))
        self.tokens_sent = end
        self.done = finished
        return Delta(new_text, completion.token_ids[start:end], logprobs, finish_reason)

    def shown(self, completion: CompletionOutput, length: int) -> CompletionOutput:
        """`completion` with only the tokens (and logprobs) that `length` characters of its text show."""
        end = self._shown_tokens(completion, length)
        if end == len(completion.token_ids):
            return completion
        logprobs = completion.logprobs[:end] if completion.logprobs is not None else None
        return dataclasses.replace(completion, token_ids=completion.token_ids[:end], logprobs=logprobs)

    def _shown_tokens(self, completion: CompletionOutput, length: int) -> int:
        """How many of the choice's tokens its first `length` characters show: all of them without a guard;
        with one, only those whose text is within it, so that a token's logprob never tells text the
        guard holds back or blocked."""
        if self.guard is None:
            return len(completion.token_ids)
        return completion.tokens_within(length)


# ---- numbered events and resumable streams ---------------------------------------------------------


class EventIds:
    """Numbers a response's events from 0: their SSE ids, which a client resumes from."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self, event: str) -> str:
        numbered = f"id: {self.next}\n{event}"
        self.next += 1
        return numbered


@dataclass(frozen=True)
class ResumeLimits:
    # Sizes in characters of the events' text (their UTF-8 is up to 4 bytes a character).
    max_chars: int = 1 << 20  # of one stream's buffered events; the oldest go first
    grace_seconds: float = 30.0  # unfollowed before the generation is aborted; finished before forgotten
    max_total_chars: int = 256 << 20  # of every stream's buffer: past it, finished streams go early, oldest first

    def __post_init__(self) -> None:
        if self.max_chars < 1 or self.max_total_chars < 1 or self.grace_seconds <= 0:
            raise ValueError("max_chars and max_total_chars must be at least 1, grace_seconds positive")


class EventsDropped(Exception):
    """The events after the requested one are no longer in the buffer."""


class FollowedStream(Protocol):
    """A resumable stream as its followers see it: held here (ResumableStream) or by another process."""

    id: str
    owner: str | None
    outlives_followers: bool

    def check_resumable_after(self, last_event: int) -> None: ...

    def follow(self, last_event: int = -1) -> AsyncIterator[str]: ...

    async def stop(self) -> None: ...


class StreamMirror(Protocol):
    """Where the streams of processes sharing them meet (server/shared_streams.py: Redis)."""

    def copy(self, stream: ResumableStream, stop_here: Callable[[str], None]) -> None:
        """Copy `stream` for the others to follow; `stop_here(id)` stops a stream here when another process asks."""

    def changed(self, stream: ResumableStream) -> None:
        """`stream` has a new event, has ended, or is forgotten."""

    async def followed_elsewhere(self, stream_id: str) -> bool: ...

    async def lookup(self, stream_id: str, owner: str | None) -> FollowedStream | None:
        """A stream another process holds, if `owner` may follow it."""

    def on_stop(self, name: str, handler: Callable[[str], None]) -> None:
        """Call `handler(id)` when another process is asked to stop `id` (one handler per `name`)."""

    async def ask_stop(self, work_id: str) -> None:
        """Ask the process running `work_id` to stop it."""

    def closing(self) -> None: ...

    async def close(self) -> None: ...


class ResumableStream:
    """One response's events (numbered from 0, see EventIds), produced by a task of their own (so the
    generation outlives a dropped connection) into a buffer that any number of followers read from an
    event id on."""

    def __init__(
        self, stream_id: str, owner: str | None, events: AsyncIterator[str], limits: ResumeLimits,
        registry: StreamRegistry, outlives_followers: bool = False,
    ) -> None:
        self.id = stream_id
        self.owner = owner  # the key id that may follow it (None: the server has no keys)
        self.outlives_followers = outlives_followers  # not aborted unfollowed: forgotten once ended and unfollowed
        self.limits = limits
        self._registry = registry
        self._buffer: deque[str] = deque()  # events first_kept .. next_number-1, with their ids
        self.first_kept = 0
        self.next_number = 0
        self.chars = 0
        self.finished = False
        self.forgotten = False  # no longer followed from its registry
        self._followers = 0
        self._waiting: list[asyncio.Future[None]] = []  # one per follower waiting for the next event
        loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = loop.call_later(limits.grace_seconds, self._grace_over)
        self._grace_check: asyncio.Future[None] | None = None  # asking Redis whether another process follows it
        self._producer = asyncio.ensure_future(self._produce(events))

    async def _produce(self, events: AsyncIterator[str]) -> None:
        try:
            async for event in events:
                self._append(event)
        except Exception:  # a bug: the followers still get an error and the end, not a silent cut
            logger.exception("resumable stream %s failed", self.id)
            failed = APIError(500, "The stream failed on the server.", code="stream_failed")
            self._append(f"id: {self.next_number}\n" + sse(failed.body_json()))
            self._append(f"id: {self.next_number}\n{SSE_DONE}")
        finally:
            self.finished = True
            self.wake()
            self._restart_timer()

    def _append(self, event: str) -> None:
        self._buffer.append(event)
        self.next_number += 1
        before = self.chars
        self.chars += len(event)
        while self.chars > self.limits.max_chars and len(self._buffer) > 1:
            self.chars -= len(self._buffer.popleft())
            self.first_kept += 1
        self._registry.resized(self, self.chars - before)
        self.wake()

    def wake(self) -> None:
        """Tell the followers (and the copy in Redis) that the stream changed."""
        if self._registry.mirror is not None:
            self._registry.mirror.changed(self)
        waiting, self._waiting = self._waiting, []
        for waiter in waiting:
            if not waiter.done():
                waiter.set_result(None)

    def _restart_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        if self._followers == 0 or self.finished:
            self._timer = asyncio.get_running_loop().call_later(self.limits.grace_seconds, self._grace_over)

    def _grace_over(self) -> None:
        """Nobody here followed the stream for the grace period, or it finished that long ago."""
        self._timer = None
        mirror = self._registry.mirror
        if self.finished or self.outlives_followers or mirror is None:
            self._expire()
            return
        self._grace_check = asyncio.ensure_future(self._expire_unless_followed_elsewhere(mirror))

    async def _expire_unless_followed_elsewhere(self, mirror: StreamMirror) -> None:
        followed = await mirror.followed_elsewhere(self.id)
        if self._timer is not None or self._followers:
            return  # followed here meanwhile, or finished: the timer runs again
        if followed:
            self._restart_timer()
        else:
            self._expire()

    def _expire(self) -> None:
        if not self.finished:
            if self.outlives_followers:
                return  # the timer starts again at its end
            self._producer.cancel()  # aborts the engine requests, records the usage as "disconnected"
        self._registry.forget(self)

    @property
    def producer(self) -> asyncio.Task[None]:
        """The task producing the events (cancelled, it stops them, and the generation)."""
        return self._producer

    def check_resumable_after(self, last_event: int) -> None:
        if last_event + 1 < self.first_kept:
            raise EventsDropped()

    def events_from(self, number: int) -> list[str]:
        """The buffered events numbered `number` on."""
        if number < self.first_kept:
            raise EventsDropped()
        return [self._buffer[i] for i in range(number - self.first_kept, len(self._buffer))]

    async def next_change(self) -> None:
        """Returns at the stream's next event, or its end."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        await waiter

    async def follow(self, last_event: int = -1) -> AsyncIterator[str]:
        """The events after `last_event`, then the live ones as they come, to the stream's end. A
        follower that falls further behind than the buffer holds gets an error event and the end."""
        self._followers += 1
        self._restart_timer()
        number = last_event + 1
        try:
            while True:
                try:
                    pending = self.events_from(number)
                except EventsDropped:
                    yield sse(dropped_events(self.id).body_json())
                    yield SSE_DONE
                    return
                for event in pending:
                    yield event
                number += len(pending)
                if self.finished and number >= self.next_number:
                    return
                if number >= self.next_number:
                    await self.next_change()
        finally:
            self._followers -= 1
            self._restart_timer()

    def cancel(self) -> None:
        """Stop the generation now and forget the stream."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._producer.cancel()
        self._registry.forget(self)

    async def wait_finished(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(self._producer)

    async def stop(self) -> None:
        """Stop the generation, forget the stream, and return once it has ended."""
        self.cancel()
        await self.wait_finished()


class StreamRegistry:
    """The resumable streams of one server, by response id; with a `mirror`, copied into Redis as they are
    produced, and those of other processes sharing that Redis followed from there (server/shared_streams.py)."""

    def __init__(self, limits: ResumeLimits | None = None, mirror: StreamMirror | None = None) -> None:
        self.limits = limits or ResumeLimits()
        self.mirror = mirror
        self._streams: dict[str, ResumableStream] = {}  # oldest first
        self.chars = 0  # buffered by the streams held

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, stream_id: str, owner: str | None, events: AsyncIterator[str],
             outlives_followers: bool = False) -> ResumableStream:
        """Start producing `events` (numbered from 0) into a new stream's buffer; `outlives_followers`: it runs to
        its end whether anyone follows it or not (a background response's)."""
        self._make_room()
        stream = ResumableStream(stream_id, owner, events, self.limits, self, outlives_followers)
        self._streams[stream_id] = stream
        if self.mirror is not None:
            self.mirror.copy(stream, self._stop_asked_elsewhere)
        return stream

    def _stop_asked_elsewhere(self, stream_id: str) -> None:
        stream = self._streams.get(stream_id)
        if stream is not None and not stream.outlives_followers:
            stream.cancel()

    def _make_room(self) -> None:
        """Over the total, forget finished streams, oldest first (live ones are bounded one by one, and
        in number by admission control)."""
        if self.chars <= self.limits.max_total_chars:
            return
        for stream in [s for s in self._streams.values() if s.finished]:
            self.forget(stream)
            if self.chars <= self.limits.max_total_chars:
                return

    def resized(self, stream: ResumableStream, change: int) -> None:
        if self._streams.get(stream.id) is stream:
            self.chars += change

    async def get(self, stream_id: str, owner: str | None) -> FollowedStream:
        """The stream, if `owner` may follow it, held here or (with a mirror) by another process; a 404 otherwise
        (unknown, forgotten, or another key's)."""
        stream: FollowedStream | None = self._streams.get(stream_id)
        if stream is None and self.mirror is not None:
            stream = await self.mirror.lookup(stream_id, owner)
        if stream is None or stream.owner != owner:
            raise APIError(404, f"No resumable stream found with id '{stream_id}'.", code="stream_not_found")
        return stream

    def forget(self, stream: ResumableStream) -> None:
        if self._streams.get(stream.id) is stream:
            del self._streams[stream.id]
            self.chars -= stream.chars
            stream.forgotten = True
            stream.wake()  # its copy in Redis goes too

    async def close(self) -> None:
        """Stop every stream (the server is shutting down)."""
        if self.mirror is not None:
            self.mirror.closing()
        streams = list(self._streams.values())
        for stream in streams:
            stream.cancel()
        await asyncio.gather(*(s.wait_finished() for s in streams))
        if self.mirror is not None:
            await self.mirror.close()


def dropped_events(stream_id: str) -> APIError:
    return APIError(
        410, f"The events of stream '{stream_id}' after that id are no longer buffered.", code="stream_events_dropped"
    )
