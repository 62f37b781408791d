"""`tool_choice: "auto"` with strict functions (`"strict": true`, as OpenAI's Structured Outputs for
function calling, and the OpenAI Agents SDK's default): the reply stays free text, but each call the model
starts is decoded under its function's parameters schema.

The constraint is an xgrammar structural tag in the model family's own call format: free text until a
call's opening (`<tool_call>` for Hermes/Qwen, `{"name": ` for Llama 3 JSON), then the text of one of the
tools' calls with its arguments under a JSON grammar, then free text again. A function without `strict`
among strict ones still has its calls written as calls, with any JSON object as arguments. As SGLang does.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llmserve.errors import InvalidRequestError
from llmserve.server.tool_calls.base import ToolParser
from llmserve.server.tool_calls.forced import function_of, parameters_of

# At most one whitespace character where JSON allows any: a real model writes `{"city": "Paris"}`, and a
# random-weight one cannot pad forever.
_MAX_WHITESPACE = 1


def any_strict(tools: Sequence[Any]) -> bool:
    return any(function_of(tool, position).get("strict") is True for position, tool in enumerate(tools))


def strict_calls_tag(parser: ToolParser, tools: Sequence[Any], parallel_tool_calls: bool) -> str:
    """The structural tag (JSON text) of replies in `parser`'s format whose calls follow the tools' schemas."""
    if not parser.call_triggers:
        raise InvalidRequestError(
            f"Strict functions under tool_choice 'auto' are not supported for the {parser.name} tool-call format "
            "(hermes and llama3_json are); tool_choice 'required' or a named function always decodes calls "
            "under their schemas.",
            param="tools",
        )
    tags = []
    for position, tool in enumerate(tools):
        function = function_of(tool, position)
        schema = parameters_of(function) if function.get("strict") is True else {"type": "object"}
        arguments = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": _MAX_WHITESPACE}
        tags.append(parser.call_tag(function["name"], arguments))
    calls = {"type": "triggered_tags", "triggers": list(parser.call_triggers), "tags": tags,
             "stop_after_first": not parallel_tool_calls}
    return json.dumps({"type": "structural_tag", "format": calls})
