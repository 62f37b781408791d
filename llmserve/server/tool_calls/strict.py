"""`tool_choice: "auto"` with strict functions (`"strict": true`, as OpenAI's Structured Outputs for
function calling, and the OpenAI Agents SDK's default): the reply stays free text, but each call the model
starts is decoded under its function's parameters schema.

The constraint is an xgrammar structural tag in the model family's own call format (`ToolParser.calls_format`):
free text until a call opens (`<tool_call>` for Hermes/Qwen, `{"name": ` for Llama 3 JSON, `[TOOL_CALLS]`
for Mistral), then one of the tools' calls with its arguments under a JSON grammar, then free text again.
A function without `strict` among strict ones still has its calls written as calls, with any JSON object
as arguments. As SGLang does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llmserve.errors import InvalidRequestError
from llmserve.server.tool_calls.base import ToolParser
from llmserve.server.tool_calls.forced import function_of, parameters_of


def any_strict(tools: Sequence[Any]) -> bool:
    return any(function_of(tool, position).get("strict") is True for position, tool in enumerate(tools))


def strict_calls_tag(parser: ToolParser, tools: Sequence[Any], parallel_tool_calls: bool) -> str:
    """The structural tag (JSON text) of replies in `parser`'s format whose calls follow the tools' schemas."""
    if not parser.call_triggers:
        raise InvalidRequestError(
            f"Strict functions under tool_choice 'auto' are not supported for the {parser.name} tool-call format.",
            param="tools",
        )
    functions = []
    for position, tool in enumerate(tools):
        function = function_of(tool, position)
        schema = parameters_of(function) if function.get("strict") is True else {"type": "object"}
        functions.append((function["name"], schema))
    return json.dumps({"type": "structural_tag", "format": parser.calls_format(functions, parallel_tool_calls)})
