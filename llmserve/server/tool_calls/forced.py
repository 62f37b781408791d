"""`tool_choice` "required" or a named function: the JSON schema that constrains decoding, and its parser.

As vLLM does, the model is made to write JSON under a grammar, so even a random-weight model returns
a valid call: for "required", an array (at least one item; at most one without parallel tool calls)
of `{"name": <one tool's name>, "parameters": <that tool's parameters>}`; for a named function, that
function's arguments object alone.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from llmserve.errors import InvalidRequestError
from llmserve.server.tool_calls.base import (
    WHITESPACE,
    ArgumentsObject,
    CallArray,
    Output,
    Status,
    ToolCallStream,
    ToolParser,
    new_call_id,
)

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_DEFINITION_KEYS = ("$defs", "definitions")


def function_of(tool: Any, position: int) -> Mapping[str, Any]:
    function = tool.get("function") if isinstance(tool, Mapping) and tool.get("type") == "function" else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidRequestError(
            f"tools[{position}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
            param=f"tools[{position}]",
        )
    return function


def parameters_of(function: Mapping[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters")
    if parameters is None:
        return copy.deepcopy(EMPTY_PARAMETERS)
    if not isinstance(parameters, Mapping):
        raise InvalidRequestError(f"the parameters of {function['name']!r} must be a JSON schema object", param="tools")
    return copy.deepcopy(dict(parameters))


def _hoist_definitions(schema: dict[str, Any], into: dict[str, dict[str, Any]]) -> None:
    """Move `$defs`/`definitions` to the root, where their `#/$defs/...` references point."""
    for key in _DEFINITION_KEYS:
        for name, definition in (schema.pop(key, None) or {}).items():
            known = into.setdefault(key, {})
            if name in known and known[name] != definition:
                raise InvalidRequestError(
                    f"two tools define {key}/{name} differently; their calls share one schema",
                    param="tools",
                )
            known[name] = definition


def required_tool_calls_schema(tools: Sequence[Any], parallel_tool_calls: bool = True) -> dict[str, Any]:
    """The schema of `tool_choice: "required"` output: a non-empty array of {name, parameters} calls."""
    if not tools:
        raise InvalidRequestError("tool_choice 'required' needs at least one tool", param="tool_choice")
    functions = [function_of(tool, position) for position, tool in enumerate(tools)]
    return calls_array_schema([(f["name"], parameters_of(f)) for f in functions], "parameters", parallel_tool_calls)


def calls_array_schema(functions: Sequence[tuple[str, dict[str, Any]]], arguments_key: str,
                       parallel: bool) -> dict[str, Any]:
    """A non-empty array of `{"name": ..., arguments_key: ...}` calls of the `functions` ((name, arguments
    schema) pairs, whose definitions move to the array's root, where their references point); one call
    at most without `parallel`."""
    definitions: dict[str, dict[str, Any]] = {}
    choices: list[dict[str, Any]] = []
    for name, arguments in functions:
        _hoist_definitions(arguments, definitions)
        choices.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, arguments_key: arguments},
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    items = choices[0] if len(choices) == 1 else {"anyOf": choices}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if not parallel:
        schema["maxItems"] = 1
    schema.update(definitions)
    return schema


def named_tool_call_schema(tools: Sequence[Any], name: str) -> dict[str, Any]:
    """The schema of a named `tool_choice` output: that function's parameters."""
    for position, tool in enumerate(tools or ()):
        function = function_of(tool, position)
        if function["name"] == name:
            return parameters_of(function)
    raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")


class _ForcedStream(ToolCallStream):
    """Optional whitespace, then the calls (an array, or one arguments object), then text (content)."""

    def __init__(self, out: Output, make_calls: Callable[[], CallArray | ArgumentsObject], opener: str) -> None:
        super().__init__(out)
        self._make_calls = make_calls
        self._opener = opener
        self._calls: CallArray | ArgumentsObject | None = None
        self._mode = "start"
        self._lead = ""

    def _push(self, ch: str) -> None:
        if self._mode == "start":
            if ch in WHITESPACE:
                self._lead += ch
                return
            if ch != self._opener:
                self._to_plain(self._lead, ch)
                return
            self._calls = self._make_calls()
            self._mode = "calls"
        if self._mode == "calls":
            assert self._calls is not None
            status = self._calls.push(ch)
            if status is Status.DONE:
                self._mode = "after"
            elif status is Status.FAILED:
                self._to_plain(self._lead + self._calls.release, ch)
            elif status is Status.BROKEN:
                self._to_plain(self._calls.release, ch)
        elif self._mode == "after":
            if ch not in WHITESPACE:
                self._to_plain("", ch)
        else:
            self._out.content(ch)

    def _to_plain(self, released: str, ch: str) -> None:
        self._out.content(released + ch)
        self._mode = "plain"

    def _end(self) -> None:
        if self._mode == "start":
            self._out.content(self._lead)
        elif self._mode == "calls" and self._calls is not None:
            self._out.content(("" if self._calls.committed else self._lead) + self._calls.finish())


class RequiredToolCallParser(ToolParser):
    """Output of `tool_choice: "required"`: `[{"name": ..., "parameters": {...}}, ...]`."""

    name = "required"

    def _make_stream(self, out: Output) -> ToolCallStream:
        return _ForcedStream(out, lambda: CallArray(out), "[")


class NamedToolCallParser(ToolParser):
    """Output of a named `tool_choice`: the arguments object of that one function."""

    name = "named"

    def __init__(self, function_name: str, new_id: Callable[[], str] = new_call_id) -> None:
        super().__init__(new_id)
        self.function_name = function_name

    def _make_stream(self, out: Output) -> ToolCallStream:
        return _ForcedStream(out, lambda: ArgumentsObject(out, self.function_name), "{")
