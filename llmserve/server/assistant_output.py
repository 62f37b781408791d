"""How a chat request's tools and the model's reasoning shape its reply.

`plan_reply` reads the request once: which tool-call format the reply is parsed in (the model family's
own for `tool_choice: "auto"`; for `"required"` or a named function, vLLM's JSON forms, decoded under
a JSON schema of the tools' parameters so that even a random-weight model returns a valid call), and
whether the reply starts with reasoning (so that structured output starts after it). Each choice then
gets a `ReplyParser`: the pipeline's post-processor that splits the released text into
`reasoning_content`, `content` and `tool_calls` deltas, the reasoning parser first. Under "auto", strict
functions have their calls decoded under their schemas too (`tool_calls.strict`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmserve.errors import InvalidRequestError
from llmserve.sampling.params import StructuredOutputsParams
from llmserve.server.postprocess import MessagePieces
from llmserve.server.protocol import ChatCompletionRequest, NamedToolChoice
from llmserve.server.reasoning import ReasoningParser, ReasoningStream
from llmserve.server.tool_calls import (
    Delta,
    NamedToolCallParser,
    RequiredToolCallParser,
    ToolCallStream,
    ToolParser,
    named_tool_call_schema,
    required_tool_calls_schema,
)
from llmserve.server.tool_calls.strict import any_strict, strict_calls_tag


@dataclass
class ReplyPlan:
    """What a chat request's reply is parsed for."""

    tool_parser: ToolParser | None  # None: no tool calls are looked for
    reasoning: ReasoningParser | None
    prompt_opened_reasoning: bool  # the prompt ends inside an open reasoning block
    structured_outputs: StructuredOutputsParams | None  # the constraint the tools add (None: none)
    # Whether the reply must be a call (tool_choice "required" or named). Else (strict functions under
    # "auto") the tools' constraint only shapes calls, and gives way to a response_format: under one, the
    # reply is that JSON and holds no call.
    calls_required: bool = False

    @property
    def parses_anything(self) -> bool:
        return self.tool_parser is not None or self.reasoning is not None

    def parser(self, new_call_id: Callable[[], str] | None = None) -> ReplyParser | None:
        """A fresh post-processor for one choice (None when the text is the content as is); its calls' ids from
        `new_call_id` (default: the tool parser's)."""
        if not self.parses_anything:
            return None
        reasoning = self.reasoning.stream(self.prompt_opened_reasoning) if self.reasoning is not None else None
        tools = self.tool_parser.stream(new_call_id) if self.tool_parser is not None else None
        return ReplyParser(reasoning, tools)


def plan_reply(
    body: ChatCompletionRequest, family_parser: ToolParser | None, reasoning: ReasoningParser | None
) -> ReplyPlan:
    """The request's tool use, checked: a tool_choice naming an unknown function, or tools for a model
    with no known tool-call format, are 400s."""
    choice = body.effective_tool_choice()
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
    if choice != "none" and not tools:
        raise InvalidRequestError("tool_choice needs tools.", param="tool_choice")

    parser: ToolParser | None = None
    schema: dict[str, Any] | None = None
    parallel = body.parallel_tool_calls is not False
    if choice == "auto":
        if family_parser is None:
            raise InvalidRequestError(
                "This model has no known tool-call format; start the server with --tool-call-parser to use "
                "tool_choice 'auto'.",
                param="tools",
            )
        parser = family_parser
        if any_strict(tools):
            tag = strict_calls_tag(parser, tools, parallel)
            return ReplyPlan(tool_parser=parser, reasoning=reasoning, prompt_opened_reasoning=False,
                             structured_outputs=StructuredOutputsParams(structural_tag=tag))
    elif choice == "required":
        schema = required_tool_calls_schema(tools, parallel_tool_calls=parallel)
        parser = RequiredToolCallParser()
    elif isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in {tool["function"]["name"] for tool in tools}:
            raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools.", param="tool_choice")
        schema = named_tool_call_schema(tools, name)
        parser = NamedToolCallParser(name)
    return ReplyPlan(
        tool_parser=parser,
        reasoning=reasoning,
        prompt_opened_reasoning=False,
        structured_outputs=None if schema is None else StructuredOutputsParams(json=json.dumps(schema)),
        calls_required=schema is not None,
    )


def reasoning_start(plan: ReplyPlan, prompt_text: str, end_token_ids: list[int]) -> list[int]:
    """Where structured output starts: after the reasoning when the reply is expected to begin with it
    (the prompt left a reasoning block open, or did not close an empty one as a template does when
    thinking is off); else at once. Also records whether the prompt opened the reasoning."""
    reasoning = plan.reasoning
    if reasoning is None:
        return []
    plan.prompt_opened_reasoning = reasoning.prompt_opens_reasoning(prompt_text)
    return [] if thinking_off(plan, prompt_text) else end_token_ids


def thinking_off(plan: ReplyPlan, prompt_text: str) -> bool:
    """Whether the prompt closed the reasoning block itself (an empty one: a template with thinking turned off)."""
    assert plan.reasoning is not None
    return not plan.prompt_opened_reasoning and prompt_text.rstrip().endswith(plan.reasoning.end)


class ReplyParser:
    """One choice's text in, message pieces out: reasoning first, then tool calls and content."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    def feed(self, text: str) -> MessagePieces:
        pieces = MessagePieces()
        if self._reasoning is not None:
            split = self._reasoning.feed(text)
            pieces.reasoning_content, text = split.reasoning, split.content
        self._add_text(pieces, text)
        return pieces

    def finish(self, finish_reason: str) -> tuple[MessagePieces, str]:
        pieces = MessagePieces()
        if self._reasoning is not None:
            split = self._reasoning.finish()
            pieces.reasoning_content = split.reasoning
            self._add_text(pieces, split.content)
        if self._tools is not None:
            _add_deltas(pieces, self._tools.finish())
            if self._tools.calls_started and finish_reason == "stop":
                finish_reason = "tool_calls"
        return pieces, finish_reason

    def _add_text(self, pieces: MessagePieces, text: str) -> None:
        if not text:
            return
        if self._tools is None:
            pieces.content += text
        else:
            _add_deltas(pieces, self._tools.feed(text))


def _add_deltas(pieces: MessagePieces, deltas: list[Delta]) -> None:
    """Add parser deltas; one call's pieces within a chunk become one entry (a call's first entry
    carries its id and name, later ones only more arguments)."""
    calls = pieces.tool_calls
    for delta in deltas:
        if delta.content is not None:
            pieces.content += delta.content
        elif delta.tool_call is not None:
            call = delta.tool_call
            if calls and calls[-1]["index"] == call["index"] and "id" not in call:
                last = calls[-1]
                last["function"] = {**last["function"], "arguments": last["function"]["arguments"] + call["function"]["arguments"]}
            else:
                calls.append(call)


def whole_tool_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamed tool-call deltas joined into the calls of a non-streamed message."""
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        index = delta["index"]
        if "id" in delta:
            calls[index] = {"id": delta["id"], "type": "function",
                            "function": {"name": delta["function"]["name"], "arguments": ""}}
        calls[index]["function"]["arguments"] += delta["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)]
