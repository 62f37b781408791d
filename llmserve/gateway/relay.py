"""A replica's reply on its way to the client through the gateway's platform: the usage counted from
what the replica reports, the output screened by the safety filter, the response id made the
gateway's own, and the request metered once it ends.

A streamed request is sent to the replica with `stream_options.continuous_usage_stats`, so every
chunk carries the usage so far: a stream that breaks off (the replica died) or that the client
leaves is metered with the tokens of the last chunk that came through. The usage fields the client
did not ask for are taken out again. With a safety filter, each choice's text goes out only as its
`OutputGuard` releases it (the server's rule, a window held back until checked), and its tokens'
logprobs and ids with it; a blocked choice ends with finish_reason "content_filter", and once every
choice has ended so, the replica's stream is closed, which aborts the generation there."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from llmserve.gateway.fold import ChatFold
from llmserve.platform.safety import OutputGuard, Verdict
from llmserve.platform.usage import UsageStatus
from llmserve.server.gateway import Meter
from llmserve.server.protocol import Usage
from llmserve.server.streaming import obfuscated

SSE_DONE = b"data: [DONE]\n\n"
EVENT_END = b"\n\n"
CONTENT_FILTER = "content_filter"

Chunk = dict[str, Any]


class RelayMeter(Meter):
    """A request's usage as its replica reports it: a response's `usage`, or a stream's running usage."""

    _completion = 0
    _cached = 0
    _details: Chunk | None = None  # completion_tokens_details (reasoning, prediction tokens), as reported

    @property
    def completion_tokens(self) -> int:
        return self._completion

    @property
    def cached_tokens(self) -> int:
        return self._cached

    def observe_usage(self, usage: Chunk) -> None:
        self.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        self._completion = int(usage.get("completion_tokens") or 0)
        self._cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        self._details = usage.get("completion_tokens_details") or self._details
        if self.first_token_at is None and self._completion:
            self.first_token_at = time.monotonic()
        self._journal_progress()

    def usage(self) -> Chunk:
        usage = Usage.of(self.prompt_tokens, self.completion_tokens, self.cached_tokens).model_dump()
        return usage if self._details is None else {**usage, "completion_tokens_details": self._details}


def dumps(data: Chunk) -> str:
    """JSON as the server writes it (pydantic's compact form, non-ASCII kept)."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


# A completion choice's logprobs: four lists, one item per token each.
COMPLETION_LOGPROBS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def logprob_items(logprobs: Chunk | None) -> list[Any]:
    """A choice's logprobs, one item per token: a chat entry, or a completion's four values."""
    if not logprobs:
        return []
    if "content" in logprobs:
        return list(logprobs["content"] or [])
    columns = [logprobs.get(name) or [] for name in COMPLETION_LOGPROBS]
    return [dict(zip(COMPLETION_LOGPROBS, values, strict=True)) for values in zip(*columns, strict=True)]


def joined_logprobs(logprobs: Chunk, items: list[Any]) -> Chunk | None:
    """`logprobs` (a choice's) holding only `items` (from `logprob_items`); None for no item."""
    if not items:
        return None
    if "content" in logprobs:
        return {**logprobs, "content": items}
    return {**logprobs, **{name: [item[name] for item in items] for name in COMPLETION_LOGPROBS}}


# One token of a choice as a reply carries it: its logprobs entry and its id (vLLM's return_token_ids),
# each None when the reply does not carry it.
Token = tuple[Any, int | None]


def tokens_of(choice: Chunk) -> list[Token]:
    entries = logprob_items(choice.get("logprobs"))
    ids = choice.get("token_ids") or []
    return [(entries[i] if i < len(entries) else None, ids[i] if i < len(ids) else None)
            for i in range(max(len(entries), len(ids)))]


class ChoiceScreen:
    """The output guard of one choice over its text so far (a chat delta's content, a completion's text),
    and the tokens of that text (their logprobs and ids): a chunk's tokens go out once all of its text
    has (tokens that made no text yet wait for the next chunk that has some), and never once the choice
    is blocked, so that no logprob or token id tells text the guard holds back or withheld."""

    def __init__(self, guard: OutputGuard) -> None:
        self.guard = guard
        self.text = ""
        self.sent = 0
        self.waiting: list[tuple[int, list[Token]]] = []  # (where their text ends, tokens)
        self.textless: list[Token] = []  # tokens whose text has not come yet
        self.logprobs_shape: Chunk | None = None  # the choice's logprobs object, to put released entries in

    def take(self, piece: str, finished: bool, tokens: list[Token]) -> tuple[str, list[Token], Verdict | None]:
        """What of the text so far (with `piece`) and of its tokens may go out now, and the verdict when
        it blocks."""
        self.text += piece
        self.textless += tokens
        if (piece or finished) and self.textless:
            self.waiting.append((len(self.text), self.textless))
            self.textless = []
        step = self.guard.feed(self.text, finished=finished)
        released = self.guard.released_text
        new = released[self.sent :]
        self.sent = len(released)
        if step.blocked:
            self.waiting.clear()
            return new, [], step.verdict
        out: list[Token] = []
        while self.waiting and self.waiting[0][0] <= len(released):
            out += self.waiting.pop(0)[1]
        return new, out, None


class Reply:
    """One reply's choices on their way out: screened, their ends noted, the first one's text kept."""

    def __init__(self, text_field: str, choices: int, guards: Callable[[], OutputGuard | None],
                 fold: ChatFold | None = None) -> None:
        self.text_field = text_field  # "content" in a chat delta or message, "text" in a completion
        self.fold = fold  # a streamed chat completion kept (`store: true`): its chunks as sent, folded
        self.choices = choices
        self._guards = guards
        self.screens: dict[int, ChoiceScreen] = {}
        self.ended: set[int] = set()
        self.blocked: list[Verdict] = []
        self.first_text = ""  # choice 0 as the client saw it (a stored conversation keeps it)
        self.first_reasoning = ""  # and its reasoning (a chat reply's reasoning_content)

    @property
    def all_blocked(self) -> bool:
        return len(self.blocked) == self.choices

    def _holder(self, choice: Chunk) -> Chunk:
        if self.text_field == "text":
            return choice
        return choice.get("delta") or choice.get("message") or {}

    def screen(self, choice: Chunk, final: bool) -> bool:
        """Screen one choice in place (`final`: its text is whole, a non-streamed reply); whether it
        still has anything to send."""
        index = int(choice.get("index") or 0)
        if index in self.ended:
            return False
        holder = self._holder(choice)
        piece = holder.get(self.text_field) or ""
        finished = final or choice.get("finish_reason") is not None
        screen = self._screen(index)
        tokens: list[Token] = []
        if screen is not None:
            piece, tokens, verdict = screen.take(piece, finished, tokens_of(choice))
            if holder.get(self.text_field) is not None or piece:
                holder[self.text_field] = piece
            _put_tokens(choice, screen, tokens)
            if verdict is not None:
                self.blocked.append(verdict)
                choice["finish_reason"] = CONTENT_FILTER
                finished = True
        if index == 0:
            self.first_text += piece
            self.first_reasoning += holder.get("reasoning_content") or ""
        if finished:
            self.ended.add(index)
        return bool(piece) or bool(tokens) or finished or _carries_more(holder, self.text_field)

    def _screen(self, index: int) -> ChoiceScreen | None:
        if index not in self.screens:
            guard = self._guards()
            if guard is None:
                return None
            self.screens[index] = ChoiceScreen(guard)
        return self.screens[index]


def _put_tokens(choice: Chunk, screen: ChoiceScreen, tokens: list[Token]) -> None:
    """The choice's logprobs and token ids: those of `tokens` (what its screen released) alone."""
    if choice.get("logprobs"):
        screen.logprobs_shape = choice["logprobs"]
    entries = [entry for entry, _ in tokens if entry is not None]
    if screen.logprobs_shape is not None and (entries or choice.get("logprobs")):
        choice["logprobs"] = joined_logprobs(screen.logprobs_shape, entries)
    if "token_ids" in choice:
        choice["token_ids"] = [token_id for _, token_id in tokens if token_id is not None]


def _carries_more(holder: Chunk, text_field: str) -> bool:
    """A delta with more than its text: the opening role, reasoning, tool calls, logprobs."""
    return any(value is not None for name, value in holder.items() if name not in (text_field, "index", "text"))


# Called once a request ran to its end (metered, before the client sees the end) with its reply.
OnCompleted = Callable[[Reply], Awaitable[None]]


class StreamRelay:
    """A streamed reply's events rewritten for the client and metered (a `proxy.StreamFilter`)."""

    def __init__(
        self, meter: RelayMeter, reply: Reply, response_id: str, *, include_usage: bool, continuous_usage: bool,
        on_completed: OnCompleted, obfuscate: bool = False,
    ) -> None:
        self.obfuscate = obfuscate  # pad each chunk as the server does (`include_obfuscation`)
        self.meter = meter
        self.reply = reply
        self.response_id = response_id
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.on_completed = on_completed
        self.last_chunk: Chunk = {}  # the shape of a usage chunk of the gateway's own
        self.failed = False  # an error event came: the replica (or its engine) failed mid-stream

    def ended(self) -> None:
        self.meter.finish(UsageStatus.DISCONNECTED)  # nothing when it was metered already

    async def events(self, upstream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The client's events, numbered anew (`id:`): the replica's numbers count events the gateway
        takes out or rewrites."""
        numbered = _EventIds()
        try:
            async for chunk in upstream:
                for event in _split(chunk):
                    data = _data_of(event)
                    if data == b"[DONE]":
                        yield numbered(await self._end())
                        return
                    out = self._rewrite(event, data)
                    if out is not None:
                        yield numbered(out)
                    if self.reply.all_blocked:  # nothing more may go out: stop the generation
                        yield numbered(self._usage_event() + await self._end())
                        return
        finally:
            self.meter.finish(UsageStatus.DISCONNECTED)
            await upstream.aclose()  # type: ignore[attr-defined]

    def _rewrite(self, event: bytes, payload: bytes | None) -> bytes | None:
        if payload is None or not payload.startswith(b"{"):
            return event
        data = json.loads(payload)
        if "error" in data:
            self.failed = True
            return event
        usage = data.get("usage")
        if usage:
            self.meter.observe_usage(usage)
        choices = data.get("choices")
        data["id"] = self.response_id
        if not choices:  # the usage chunk
            return f"data: {dumps(data)}\n\n".encode() if self.include_usage else None
        self.last_chunk = data
        data["choices"] = [c for c in choices if self.reply.screen(c, final=False)]
        if not data["choices"]:
            return None
        if self.reply.fold is not None:
            self.reply.fold.add(data)
        if not self.continuous_usage:
            data["usage"] = None
        event = f"data: {dumps(data)}\n\n"
        return (obfuscated(event) if self.obfuscate else event).encode()

    def _usage_event(self) -> bytes:
        if not self.include_usage:
            return b""
        replaced = {"choices": [], "usage": self.meter.usage()}
        chunk = {name: replaced.get(name, value) for name, value in self.last_chunk.items()}
        return f"data: {dumps(chunk)}\n\n".encode()

    async def _end(self) -> bytes:
        """Meter the request (before the client sees the end), then hand the reply over; `[DONE]`."""
        # One turn of the event loop first: the replica's last events may have come in one read, sent on
        # without a pause, and a client that hung up meanwhile must cancel this stream (metered
        # disconnected) rather than see it metered completed.
        await asyncio.sleep(0)
        if self.failed:
            await self.meter.finish_durably(UsageStatus.ERROR)
            return SSE_DONE
        blocked = bool(self.reply.blocked)
        await self.meter.finish_durably(CONTENT_FILTER if blocked else UsageStatus.COMPLETED)
        await self.on_completed(self.reply)
        return SSE_DONE


def _split(chunk: bytes) -> list[bytes]:
    """A relayed chunk's whole events (the proxy sends only whole ones), each with its blank line."""
    return [part + EVENT_END for part in chunk.split(EVENT_END) if part]


def _data_of(event: bytes) -> bytes | None:
    """An event's `data:` field (the replica writes one line of it, after its `id:`)."""
    for line in event.split(b"\n"):
        if line.startswith(b"data: "):
            return line[6:]
    return None


class _EventIds:
    """Numbers the events going out from 0, as the server does (each gets an `id:` line)."""

    def __init__(self) -> None:
        self.next = 0

    def __call__(self, events: bytes) -> bytes:
        out = []
        for event in _split(events):
            if not event.startswith(b"id: "):
                event = b"id: %d\n" % self.next + event
            else:  # the replica's number: replaced
                event = b"id: %d\n" % self.next + event.split(b"\n", 1)[1]
            out.append(event)
            self.next += 1
        return b"".join(out)
