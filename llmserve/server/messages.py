"""A chat request's messages as the chat template takes them, checked on the way (`llmserve serve`'s
chat endpoint and /tokenize, and the gateway, which stores and screens them)."""

from __future__ import annotations

from typing import Any

from llmserve.errors import InvalidRequestError
from llmserve.platform.conversations import part_image_urls
from llmserve.server.protocol import ChatMessage

# A message entry's content parts, as OpenAI's API takes them (its image_url parts with their URLs), where it holds
# images: the template reads them with each image as `{"type": "image"}`, a stored conversation keeps them.
IMAGE_PARTS = "image_parts"


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: text content ("developer" read as "system"), an
    assistant's tool calls and reasoning (`reasoning_content`, the name templates read), a tool result's call id."""
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
        reasoning = message.reasoning_content or message.reasoning
        if reasoning:
            if message.role != "assistant":
                field = "reasoning_content" if message.reasoning_content else "reasoning"
                raise InvalidRequestError("Only assistant messages have reasoning.", param=f"messages[{i}].{field}")
            entry["reasoning_content"] = reasoning
        if message.image_urls():
            if message.role != "user":
                raise InvalidRequestError("Only user messages hold images.", param=f"messages[{i}].content")
            entry[IMAGE_PARTS] = list(message.content)
        converted.append(entry)
    return converted


def image_urls(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """Every image of the messages, in order: (its URL, the parameter that names it)."""
    return [
        (part["image_url"]["url"], f"messages[{i}].content[{j}].image_url")
        for i, message in enumerate(messages) if isinstance(message.content, list)
        for j, part in enumerate(message.content) if part["type"] == "image_url"
    ]


def entry_image_urls(messages: list[dict[str, Any]], param: str) -> list[tuple[str, str]]:
    """Every image of messages as the template takes them (a stored conversation's), in order, each named by
    `param`."""
    return [(url, param) for message in messages for url in part_image_urls(message.get(IMAGE_PARTS, ()))]


def wire_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the template takes them back in OpenAI's form: those with images as their content parts."""
    return [{key: value for key, value in message.items() if key != IMAGE_PARTS} | {"content": message[IMAGE_PARTS]}
            if IMAGE_PARTS in message else message for message in messages]


def with_image_parts(messages: list[dict[str, Any]], takes_parts: bool, placeholder: str) -> list[dict[str, Any]]:
    """Messages as a vision-language model's template takes them: a message with images as its content parts
    (`{"type": "image"}` where each image goes), for a template that reads parts; for one that reads text only,
    as its text after a placeholder line per image (vLLM's way)."""
    out = []
    for message in messages:
        parts = message.get(IMAGE_PARTS)
        if parts is None:
            out.append(message)
            continue
        message = {key: value for key, value in message.items() if key != IMAGE_PARTS}
        if takes_parts:
            message["content"] = [{"type": "image"} if part["type"] == "image_url" else part for part in parts]
        else:
            images = sum(part["type"] == "image_url" for part in parts)
            message["content"] = f"{placeholder}\n" * images + message["content"]
        out.append(message)
    return out

