"""Tool-call results and stream deltas in OpenAI's shapes, and the pieces every family's parser shares.

Every parser is a character-level state machine (`ToolCallStream`) fed text deltas; the non-streamed
`parse` runs the same machine over the whole text, so streamed and non-streamed results agree for
any split of the text by construction. Decisions depend only on the characters seen so far:

* plain text is content; text that could still be the start of a call marker is held back, and
  released as content as soon as it cannot be one (or when the output ends);
* a call is committed (its id and name sent) once its name is known and its arguments begin, or
  when its object closes; the arguments then stream as they are generated, validated by a JSON
  scanner, and end exactly where their JSON value ends;
* a call that turns out malformed before it is committed (not JSON, no name, a marker followed by
  something else, output cut short) is returned as content, raw; one that turns malformed after it
  was committed keeps the arguments generated so far (as OpenAI's own truncated calls do) and the
  rest of the text is content;
* whitespace touching a call (before its marker, between calls, after the last) is call syntax,
  not content.
"""

from __future__ import annotations

import abc
import enum
import json
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from llmserve.server.tool_calls.json_scanner import JsonScanner, Step

WHITESPACE = " \t\n\r"
NAME_KEY = "name"
ARGUMENT_KEYS: tuple[str, ...] = ("arguments", "parameters")
EXTRA_KEYS: tuple[str, ...] = ("id", "type")  # other keys seen in calls; any else means "not a call"
EMPTY_ARGUMENTS = "{}"


def new_call_id() -> str:
    """An OpenAI-style tool-call id: "call_" and 24 random hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call; `arguments` is JSON text, as OpenAI returns it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class Delta:
    """One streamed piece: either content text, or one tool-call delta in OpenAI's streaming shape.

    A call's first delta is {"index", "id", "type": "function", "function": {"name", "arguments": ""}};
    then {"index", "function": {"arguments": PIECE}} for each piece of its arguments.
    """

    content: str | None = None
    tool_call: dict[str, Any] | None = None


def assemble(deltas: Iterable[Delta]) -> tuple[str | None, list[ToolCall]]:
    """Join streamed deltas into the non-streamed result: (content or None when empty, calls)."""
    content: list[str] = []
    heads: dict[int, tuple[str, str]] = {}
    arguments: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.content is not None:
            content.append(delta.content)
        elif delta.tool_call is not None:
            index = delta.tool_call["index"]
            if "id" in delta.tool_call:
                heads[index] = (delta.tool_call["id"], delta.tool_call["function"]["name"])
            arguments.setdefault(index, []).append(delta.tool_call["function"]["arguments"])
    calls = [ToolCall(heads[i][0], heads[i][1], "".join(arguments[i])) for i in sorted(heads)]
    return "".join(content) or None, calls


class Output:
    """Collects deltas, merging adjacent content pieces and adjacent argument pieces of one call."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        self._new_id = new_id
        self._deltas: list[Delta] = []
        self.calls_opened = 0

    def content(self, text: str) -> None:
        if not text:
            return
        last = self._deltas[-1] if self._deltas else None
        if last is not None and last.content is not None:
            self._deltas[-1] = Delta(content=last.content + text)
        else:
            self._deltas.append(Delta(content=text))

    def open_call(self, name: str) -> int:
        index = self.calls_opened
        self.calls_opened += 1
        head = {"index": index, "id": self._new_id(), "type": "function", "function": {"name": name, "arguments": ""}}
        self._deltas.append(Delta(tool_call=head))
        return index

    def arguments(self, index: int, text: str) -> None:
        if not text:
            return
        last = self._deltas[-1] if self._deltas else None
        call = last.tool_call if last is not None else None
        if call is not None and call["index"] == index and "id" not in call:
            self._deltas[-1] = Delta(tool_call={"index": index, "function": {"arguments": call["function"]["arguments"] + text}})
        else:
            self._deltas.append(Delta(tool_call={"index": index, "function": {"arguments": text}}))

    def take(self) -> list[Delta]:
        deltas, self._deltas = self._deltas, []
        return deltas


class Status(enum.Enum):
    """What a sub-machine (one call, or an array of calls) says after a character."""

    MORE = "more"  # consumed; not finished
    DONE = "done"  # consumed; finished
    FAILED = "failed"  # not consumed; nothing was committed: `release` is its raw text
    BROKEN = "broken"  # not consumed; something was committed: `release` is text to return as content


class MarkedText:
    """Plain text in which call markers may appear; holds back only what could still become a marker."""

    def __init__(self, out: Output, markers: tuple[str, ...]) -> None:
        self._out = out
        self._markers = markers
        self._longest = max(len(marker) for marker in markers)
        self._held = ""
        self.strip_leading = False  # set after a call: the whitespace that follows it is call syntax

    def push(self, ch: str) -> tuple[str, str] | None:
        """Feed one character; on a complete marker, return (whitespace held before it, marker)."""
        if self.strip_leading:
            if ch in WHITESPACE:
                return None
            self.strip_leading = False
        held = self._held + ch
        for marker in self._markers:
            if held.endswith(marker):
                self._held = ""
                return held[: -len(marker)], marker
        keep = self._marker_prefix_length(held)
        head, tail = held[: len(held) - keep], held[len(held) - keep :]
        body = head.rstrip(WHITESPACE)
        self._out.content(body)
        self._held = head[len(body) :] + tail
        return None

    def flush(self) -> None:
        self._out.content(self._held)
        self._held = ""

    def _marker_prefix_length(self, text: str) -> int:
        for size in range(min(len(text), self._longest - 1), 0, -1):
            suffix = text[-size:]
            if any(marker.startswith(suffix) for marker in self._markers):
                return size
        return 0


class _E(enum.Enum):
    OPEN = 0
    KEY_OR_CLOSE = 1
    KEY = 2
    IN_KEY = 3
    COLON = 4
    VALUE = 5
    IN_VALUE = 6
    AFTER = 7


class CallObject:
    """One `{"name": NAME, "arguments": {...}}` object (the arguments key may be `parameters`)."""

    def __init__(self, out: Output, argument_keys: tuple[str, ...] = ARGUMENT_KEYS) -> None:
        self._out = out
        self._argument_keys = argument_keys
        self._state = _E.OPEN
        self._scanner = JsonScanner()
        self._text = ""  # the key or value being scanned
        self._key = ""
        self._role = ""  # what the value being scanned is: "name", "arguments" or "other"
        self._name: str | None = None
        self._arguments: str | None = None  # held until the call is committed
        self._index: int | None = None
        self.raw = ""
        self.release = ""

    @property
    def committed(self) -> bool:
        return self._index is not None

    def push(self, ch: str) -> Status:
        status = self._step(ch)
        if status in (Status.MORE, Status.DONE):
            self.raw += ch
        elif status is Status.FAILED:
            self.release = self.raw
        return status

    def finish(self) -> str:
        """End of output inside the object: the text to return as content (all of it unless committed)."""
        return "" if self.committed else self.raw

    def _step(self, ch: str) -> Status:
        state = self._state
        if state is _E.OPEN:
            if ch != "{":
                return Status.FAILED
            self._state = _E.KEY_OR_CLOSE
            return Status.MORE
        if state in (_E.KEY_OR_CLOSE, _E.KEY, _E.COLON, _E.VALUE, _E.AFTER) and ch in WHITESPACE:
            return Status.MORE
        if state in (_E.KEY_OR_CLOSE, _E.KEY):
            if ch == "}" and state is _E.KEY_OR_CLOSE:
                return self._close()
            return self._start_scan(ch, _E.IN_KEY)
        if state is _E.IN_KEY:
            return self._key_char(ch)
        if state is _E.COLON:
            if ch != ":":
                return self._invalid()
            self._state = _E.VALUE
            return Status.MORE
        if state is _E.VALUE:
            return self._value_start(ch)
        if state is _E.IN_VALUE:
            return self._value_char(ch)
        if ch == ",":
            self._state = _E.KEY
            return Status.MORE
        return self._close() if ch == "}" else self._invalid()

    def _invalid(self) -> Status:
        if not self.committed:
            return Status.FAILED
        self.release = ""
        return Status.BROKEN

    def _start_scan(self, ch: str, state: _E) -> Status:
        self._scanner = JsonScanner()
        self._text = ""
        self._state = state
        return self._key_char(ch) if state is _E.IN_KEY else self._value_char(ch)

    def _key_char(self, ch: str) -> Status:
        step = self._scanner.push(ch)
        if step is Step.INVALID or (not self._text and ch != '"'):
            return self._invalid()
        if step is Step.DONE:
            key = json.loads(self._text + ch)
            if not self.committed and key not in (NAME_KEY, *self._argument_keys, *EXTRA_KEYS):
                return Status.FAILED  # e.g. a JSON answer that is not a call at all
            self._key = key
            self._state = _E.COLON
        self._text += ch
        return Status.MORE

    def _value_start(self, ch: str) -> Status:
        if self._key == NAME_KEY and self._name is None:
            if ch != '"':
                return self._invalid()
            self._role = "name"
        elif self._key in self._argument_keys and self._arguments is None:
            self._role = "arguments"
            self._arguments = ""
        else:
            self._role = "other"
        return self._start_scan(ch, _E.IN_VALUE)

    def _value_char(self, ch: str) -> Status:
        step = self._scanner.push(ch)
        if step is Step.INVALID:
            return self._invalid()
        if step is Step.ENDED:
            self._end_value()
            return self._step(ch)
        self._text += ch
        if self._role == "arguments":
            self._arguments = self._text
            if self._index is None:
                self._commit_if_ready()  # sends everything so far, this character included
            else:
                self._out.arguments(self._index, ch)
        if step is Step.DONE:
            self._end_value()
        return Status.MORE

    def _end_value(self) -> None:
        if self._role == "name":
            self._name = json.loads(self._text)
            self._commit_if_ready()
        self._state = _E.AFTER

    def _commit_if_ready(self) -> None:
        if self._index is None and self._name is not None and self._arguments is not None:
            self._index = self._out.open_call(self._name)
            self._out.arguments(self._index, self._arguments)

    def _close(self) -> Status:
        if self._name is None:
            return self._invalid()
        if self._arguments is None:
            self._arguments = EMPTY_ARGUMENTS
            self._commit_if_ready()
        return Status.DONE


class _A(enum.Enum):
    OPEN = 0
    FIRST = 1
    NEXT = 2
    IN_CALL = 3
    AFTER = 4


class CallArray:
    """A JSON array of call objects: `[{"name": ..., "arguments": ...}, ...]`."""

    def __init__(self, out: Output, argument_keys: tuple[str, ...] = ARGUMENT_KEYS) -> None:
        self._out = out
        self._argument_keys = argument_keys
        self._state = _A.OPEN
        self._call: CallObject | None = None
        self._any_committed = False
        self._raw = ""  # text before the first committed call, released if none ever is
        self.release = ""

    @property
    def committed(self) -> bool:
        return self._any_committed

    def push(self, ch: str) -> Status:
        state = self._state
        if state is _A.OPEN:
            if ch != "[":
                return Status.FAILED
            self._state = _A.FIRST
        elif state is _A.IN_CALL:
            return self._call_char(ch)
        elif ch in WHITESPACE:
            pass
        elif state is _A.AFTER:
            if ch == "]":
                return Status.DONE
            if ch != ",":
                self.release = ""
                return Status.BROKEN
            self._state = _A.NEXT
        elif ch == "]" and state is _A.FIRST:
            return Status.DONE
        elif ch == "{":
            self._call = CallObject(self._out, self._argument_keys)
            self._state = _A.IN_CALL
            return self._call_char(ch)
        else:
            return self._fail("")
        if not self._any_committed:
            self._raw += ch
        return Status.MORE

    def finish(self) -> str:
        """End of output inside the array: the text to return as content."""
        pending = self._call.finish() if self._state is _A.IN_CALL and self._call is not None else ""
        return pending if self._any_committed else self._raw + pending

    def _call_char(self, ch: str) -> Status:
        assert self._call is not None
        status = self._call.push(ch)
        if status is Status.FAILED:
            return self._fail(self._call.release)
        if status is Status.BROKEN:
            self.release = self._call.release
            return Status.BROKEN
        if self._call.committed:
            self._any_committed = True
        if status is Status.DONE:
            self._state = _A.AFTER
        return Status.MORE

    def _fail(self, call_text: str) -> Status:
        if self._any_committed:
            self.release = call_text
            return Status.BROKEN
        self.release = self._raw + call_text
        return Status.FAILED


class ArgumentsObject:
    """A call's arguments as a bare JSON object (the name is known beforehand): committed at its "{".

    OpenAI's arguments are always an object, so anything else is not a call.
    """

    def __init__(self, out: Output, name: str) -> None:
        self._out = out
        self._name = name
        self._scanner = JsonScanner()
        self._index: int | None = None
        self.release = ""

    @property
    def committed(self) -> bool:
        return self._index is not None

    def push(self, ch: str) -> Status:
        if self._index is None and ch != "{":
            return Status.FAILED
        step = self._scanner.push(ch)
        if step is Step.INVALID:
            return Status.BROKEN
        if self._index is None:
            self._index = self._out.open_call(self._name)
        self._out.arguments(self._index, ch)
        return Status.DONE if step is Step.DONE else Status.MORE

    def finish(self) -> str:
        return ""  # nothing is held: the call is committed at its first character


class ToolCallStream(abc.ABC):
    """A streaming parser for one output: `feed` text deltas, then `finish` once."""

    def __init__(self, out: Output) -> None:
        self._out = out

    def feed(self, delta: str) -> list[Delta]:
        for ch in delta:
            self._push(ch)
        return self._out.take()

    def finish(self) -> list[Delta]:
        self._end()
        return self._out.take()

    @property
    def calls_started(self) -> int:
        """How many calls have been committed so far (finish_reason is "tool_calls" when any were)."""
        return self._out.calls_opened

    @abc.abstractmethod
    def _push(self, ch: str) -> None: ...

    @abc.abstractmethod
    def _end(self) -> None: ...


# At most one whitespace character where JSON allows any in a strict call's arguments: a real model writes
# `{"city": "Paris"}`, and a random-weight one cannot pad forever.
STRICT_MAX_WHITESPACE = 1


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    """xgrammar's structural-tag format of JSON under `schema`."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": STRICT_MAX_WHITESPACE}


class ToolParser(abc.ABC):
    """One family's tool-call format: `parse` a whole output, or `stream` one as it is generated."""

    name: ClassVar[str]
    # The output must be decoded with skip_special_tokens=False: the markers are special tokens.
    keep_special_tokens: ClassVar[bool] = False
    # Where a call starts in free text, for decoding strict calls under tool_choice "auto" (`calls_format`);
    # empty for the forced formats, whose whole reply is decoded under a schema.
    call_triggers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, new_id: Callable[[], str] = new_call_id) -> None:
        self._new_id = new_id

    def stream(self, new_id: Callable[[], str] | None = None) -> ToolCallStream:
        """A stream of one output; its calls' ids from `new_id` (default: this parser's)."""
        return self._make_stream(Output(new_id or self._new_id))

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        stream = self.stream()
        return assemble([*stream.feed(text), *stream.finish()])

    def calls_format(self, functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> dict[str, Any]:
        """xgrammar's structural-tag format of replies in this family's form whose calls of the `functions`
        ((name, arguments schema) pairs) follow their schemas: free text until a call opens, each call
        whole, free text again; with `parallel` false, nothing after the first call."""
        tags = [self.call_tag(name, json_schema_format(schema)) for name, schema in functions]
        return {"type": "triggered_tags", "triggers": list(self.call_triggers), "tags": tags,
                "stop_after_first": not parallel}

    def call_tag(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """One call of function `name` as xgrammar's structural-tag `tag`: the text before the arguments,
        the arguments under the `arguments` format, the text after; `begin` starts with a call trigger."""
        raise NotImplementedError(f"the {self.name} tool-call format has no call tag")

    @abc.abstractmethod
    def _make_stream(self, out: Output) -> ToolCallStream: ...
