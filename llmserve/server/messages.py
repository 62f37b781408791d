"""A chat request's messages as the chat template takes them, checked on the way (`llmserve serve`'s
chat endpoint and /tokenize, and the gateway, which stores and screens them)."""

from __future__ import annotations

from typing import Any

from llmserve.errors import InvalidRequestError
from llmserve.server.protocol import ChatCompletionRequest, ChatMessage


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: text content ("developer" read as "system"), an
    assistant's tool calls and a tool result's call id."""
    converted = []
    for i, message in enumerate(messages):
        if message.content is None and message.role != "assistant":
            raise InvalidRequestError(
                f"A {message.role} message needs content.", param=f"messages[{i}].content"
            )
        if message.tool_calls and message.role != "assistant":
            raise InvalidRequestError("Only assistant messages have tool_calls.", param=f"messages[{i}].tool_calls")
        if message.tool_call_id is not None and message.role != "tool":
            raise InvalidRequestError("Only tool messages have a tool_call_id.", param=f"messages[{i}].tool_call_id")
        if message.role == "tool" and not message.tool_call_id:
            raise InvalidRequestError(
                "A tool message needs the tool_call_id of the call it answers.", param=f"messages[{i}].tool_call_id"
            )
        entry: dict[str, Any] = {
            "role": "system" if message.role == "developer" else message.role, "content": message.text()
        }
        if message.tool_calls:
            entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        converted.append(entry)
    return converted


def uses_tools(body: ChatCompletionRequest) -> bool:
    return bool(body.tools) or any(m.role == "tool" or m.tool_calls for m in body.messages)
