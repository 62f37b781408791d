"""Tool-call formats of the model families we serve: Hermes/Qwen, Llama 3.x JSON, Mistral.

See `base` for the rules every format follows (what is held back, when a call is committed, what a
malformed call becomes).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from llmserve.server.tool_calls.base import (
    WHITESPACE,
    ArgumentsObject,
    CallArray,
    CallObject,
    MarkedText,
    Output,
    Status,
    ToolCallStream,
    ToolParser,
    json_schema_format,
    new_call_id,
)
from llmserve.server.tool_calls.forced import calls_array_schema

HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
_MISTRAL_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


class _HermesStream(ToolCallStream):
    """Text, then `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks (text may follow)."""

    def __init__(self, out: Output) -> None:
        super().__init__(out)
        self._text = MarkedText(out, (HERMES_START,))
        self._mode = "text"
        self._lead = ""  # whitespace before the marker, the marker, whitespace after it
        self._call = CallObject(out)
        self._tail = ""  # after a call's object: whitespace and the closing tag so far

    def _push(self, ch: str) -> None:
        if self._mode == "text":
            found = self._text.push(ch)
            if found is not None:
                self._lead = found[0] + found[1]
                self._mode = "open"
        elif self._mode == "open" and ch in WHITESPACE:
            self._lead += ch
        elif self._mode in ("open", "call"):
            if self._mode == "open":
                self._call = CallObject(self._out)
                self._mode = "call"
            self._call_char(ch)
        else:
            self._closing_char(ch)

    def _call_char(self, ch: str) -> None:
        status = self._call.push(ch)
        if status is Status.DONE:
            self._mode, self._tail = "close", ""
        elif status in (Status.FAILED, Status.BROKEN):
            lead = self._lead if status is Status.FAILED else ""
            self._out.content(lead + self._call.release)
            self._mode = "text"
            self._push(ch)

    def _closing_char(self, ch: str) -> None:
        self._tail += ch
        seen = self._tail.lstrip(WHITESPACE)
        if HERMES_END.startswith(seen):
            if seen == HERMES_END:
                self._mode = "text"
                self._text.strip_leading = True
            return
        self._mode = "text"
        self._text.strip_leading = True
        for replayed in self._tail:
            self._push(replayed)

    def _end(self) -> None:
        if self._mode == "text":
            self._text.flush()
        elif self._mode == "open":
            self._out.content(self._lead)
        elif self._mode == "call" and not self._call.committed:
            self._out.content(self._lead + self._call.finish())
        # "close": the call is complete; a closing tag cut short is call syntax.


class HermesToolParser(ToolParser):
    """Hermes 2 Pro / Qwen 2.5 / Qwen 3: `<tool_call>` JSON blocks; text before them is content."""

    name = "hermes"
    call_triggers = (HERMES_START,)

    def _make_stream(self, out: Output) -> ToolCallStream:
        return _HermesStream(out)

    def call_tag(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        begin = f'{HERMES_START}\n{{"name": {json.dumps(name)}, "arguments": '  # as the chat templates write it
        return {"type": "tag", "begin": begin, "content": arguments, "end": f"}}\n{HERMES_END}"}


class _Llama3JsonStream(ToolCallStream):
    """At the very start (after optional whitespace and `<|python_tag|>`): call objects separated by `;`."""

    def __init__(self, out: Output) -> None:
        super().__init__(out)
        self._mode = "start"
        self._lead = ""  # leading whitespace and tag, or the separator before the current call
        self._call = CallObject(out)

    def _push(self, ch: str) -> None:
        mode = self._mode
        if mode == "plain":
            self._out.content(ch)
        elif mode == "call":
            self._call_char(ch)
        elif mode == "separator":
            self._separator_char(ch)
        elif ch in WHITESPACE and mode in ("start", "tagged"):
            self._lead += ch
        elif mode == "tag" or (mode == "start" and ch == PYTHON_TAG[0]):
            self._tag_char(ch)
        elif ch == "{":
            self._start_call(ch)
        else:
            self._to_plain(self._lead, ch)

    def _tag_char(self, ch: str) -> None:
        so_far = self._lead.lstrip(WHITESPACE) + ch
        if not PYTHON_TAG.startswith(so_far):
            self._to_plain(self._lead, ch)
            return
        self._lead += ch
        self._mode = "tagged" if so_far == PYTHON_TAG else "tag"

    def _start_call(self, ch: str) -> None:
        self._call = CallObject(self._out)
        self._mode = "call"
        self._call_char(ch)

    def _call_char(self, ch: str) -> None:
        status = self._call.push(ch)
        if status is Status.DONE:
            self._mode, self._lead = "separator", ""
        elif status is Status.FAILED:
            self._to_plain(self._lead + self._call.release, ch)
        elif status is Status.BROKEN:
            self._to_plain(self._call.release, ch)

    def _separator_char(self, ch: str) -> None:
        if ch in WHITESPACE or ch == ";":
            self._lead += ch
        elif ch == "{":
            self._lead = ""  # the separator is call syntax, even if what follows is not a call
            self._start_call(ch)
        else:
            self._to_plain("", ch)  # the separator was call syntax

    def _to_plain(self, released: str, ch: str) -> None:
        self._out.content(released)
        self._mode = "plain"
        self._out.content(ch)

    def _end(self) -> None:
        if self._mode in ("start", "tag", "tagged"):
            self._out.content(self._lead)
        elif self._mode == "call" and not self._call.committed:
            self._out.content(self._lead + self._call.finish())


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1/3.2/3.3 JSON tool calls: `{"name": ..., "parameters": {...}}`, several joined by `;`."""

    name = "llama3_json"
    keep_special_tokens = True  # <|python_tag|>
    call_triggers = ('{"name": ',)

    def _make_stream(self, out: Output) -> ToolCallStream:
        return _Llama3JsonStream(out)

    def call_tag(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tag", "begin": f'{{"name": {json.dumps(name)}, "parameters": ', "content": arguments, "end": "}"}


class _MistralStream(ToolCallStream):
    """Text, then `[TOOL_CALLS]` and a JSON array of calls, or (newer) `[TOOL_CALLS]name[ARGS]{...}` calls."""

    def __init__(self, out: Output) -> None:
        super().__init__(out)
        self._text = MarkedText(out, (MISTRAL_TOOL_CALLS,))
        self._mode = "text"
        self._lead = ""
        self._name = ""
        self._calls: CallArray | CallObject | ArgumentsObject = CallArray(out)

    def _push(self, ch: str) -> None:
        mode = self._mode
        if mode == "text":
            found = self._text.push(ch)
            if found is not None:
                self._lead, self._mode = found[0] + found[1], "marker"
        elif mode == "marker":
            self._after_marker(ch)
        elif mode == "name":
            self._name_char(ch)
        elif mode == "args_marker":
            self._args_marker_char(ch)
        else:
            self._calls_char(ch)

    def _after_marker(self, ch: str) -> None:
        if ch in WHITESPACE:
            self._lead += ch
        elif ch in "[{":
            self._calls = CallArray(self._out) if ch == "[" else CallObject(self._out)
            self._mode = "calls"
            self._calls_char(ch)
        elif ch in _MISTRAL_NAME_CHARS:
            self._lead += ch
            self._name, self._mode = ch, "name"
        else:
            self._fail(ch)

    def _name_char(self, ch: str) -> None:
        if ch in _MISTRAL_NAME_CHARS:
            self._name += ch
            self._lead += ch
        elif ch == MISTRAL_ARGS[0]:
            self._lead += ch
            self._mode = "args_marker"
        else:
            self._fail(ch)

    def _args_marker_char(self, ch: str) -> None:
        seen = self._lead[self._lead.rindex(MISTRAL_ARGS[0]) :] + ch
        if not MISTRAL_ARGS.startswith(seen):
            self._fail(ch)
            return
        self._lead += ch
        if seen == MISTRAL_ARGS:
            self._calls = ArgumentsObject(self._out, self._name)
            self._mode = "args"

    def _calls_char(self, ch: str) -> None:
        if self._mode == "args" and not self._calls.committed and ch in WHITESPACE:
            self._lead += ch
            return
        status = self._calls.push(ch)
        if status is Status.DONE:
            self._mode = "text"
            self._text.strip_leading = True
        elif status is Status.FAILED:
            self._fail(ch, self._calls.release)
        elif status is Status.BROKEN:
            self._out.content(self._calls.release)
            self._mode = "text"
            self._push(ch)

    def _fail(self, ch: str, call_text: str = "") -> None:
        self._out.content(self._lead + call_text)
        self._mode = "text"
        self._push(ch)

    def _end(self) -> None:
        if self._mode == "text":
            self._text.flush()
        elif self._mode in ("marker", "name", "args_marker"):
            self._out.content(self._lead)
        else:
            self._out.content(("" if self._calls.committed else self._lead) + self._calls.finish())


class MistralToolParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` or `[TOOL_CALLS]name[ARGS]{...}`.
    `calls_by_name`: the model writes the second form (its chat template does), which strict calls follow."""

    name = "mistral"
    keep_special_tokens = True  # [TOOL_CALLS] and [ARGS] are special tokens
    call_triggers = (MISTRAL_TOOL_CALLS,)

    def __init__(self, new_id: Callable[[], str] = new_call_id, calls_by_name: bool = False) -> None:
        super().__init__(new_id)
        self.calls_by_name = calls_by_name

    def _make_stream(self, out: Output) -> ToolCallStream:
        return _MistralStream(out)

    def calls_format(self, functions: list[tuple[str, dict[str, Any]]], parallel: bool) -> dict[str, Any]:
        if self.calls_by_name:
            return super().calls_format(functions, parallel)
        array = calls_array_schema(functions, "arguments", parallel)
        tag = {"type": "tag", "begin": MISTRAL_TOOL_CALLS, "content": json_schema_format(array), "end": ""}
        return {"type": "triggered_tags", "triggers": [MISTRAL_TOOL_CALLS], "tags": [tag], "stop_after_first": True}

    def call_tag(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        return {"type": "tag", "begin": f"{MISTRAL_TOOL_CALLS}{name}{MISTRAL_ARGS}", "content": arguments, "end": ""}
