"""Tool calls in model output: OpenAI-shaped results, one parser per model family, and the forced formats.

Public API: `ToolCall`, `Delta`, `assemble`, `ToolParser` (`parse(text)`, `stream()` → `ToolCallStream`
with `feed(delta)` / `finish()`), the family parsers, `tool_parser(name)`, `tool_parser_for(name,
chat_template, architecture)`, and for `tool_choice` "required"/named: `required_tool_calls_schema`,
`named_tool_call_schema`, `RequiredToolCallParser`, `NamedToolCallParser`.
"""

from __future__ import annotations

from llmserve.server.tool_calls.base import Delta, ToolCall, ToolCallStream, ToolParser, assemble, new_call_id
from llmserve.server.tool_calls.families import HermesToolParser, Llama3JsonToolParser, MistralToolParser
from llmserve.server.tool_calls.forced import (
    NamedToolCallParser,
    RequiredToolCallParser,
    named_tool_call_schema,
    required_tool_calls_schema,
)
from llmserve.server.tool_calls.selection import TOOL_PARSERS, tool_parser, tool_parser_for

__all__ = [
    "TOOL_PARSERS",
    "Delta",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "NamedToolCallParser",
    "RequiredToolCallParser",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
    "assemble",
    "named_tool_call_schema",
    "new_call_id",
    "required_tool_calls_schema",
    "tool_parser",
    "tool_parser_for",
]
