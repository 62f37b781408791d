"""A stored conversation's messages in the three shapes they travel in: chat messages (as the chat template takes
them, `template_messages`), the rows the store keeps, and OpenAI's conversation items.

The store keeps one row per OpenAI item: a text (or text and images) message, an assistant's call of a tool
(`tool_call`: its call id, name and arguments), a tool's output (role "tool", with the `tool_call_id` of the
call it answers), and an assistant's reasoning (`reasoning`: its summary; left out of the next turns' prompts).
An assistant's chat message with tool calls is stored as its text (where it has any), then one row per call; read
back, the calls join the assistant message before them, so the template sees the message the model wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from llmserve.platform.conversations import MAX_CALL_ID_LENGTH, Message
from llmserve.server.errors import APIError, unsupported
from llmserve.server.messages import IMAGE_PARTS

ChatMessages = list[dict[str, Any]]  # as the chat template takes them (`template_messages`)

MAX_ITEMS = 20  # added by one call, as OpenAI
ITEM_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")


# ---- chat messages <-> stored rows ---------------------------------------------------------------------------


def stored_turns(messages: ChatMessages) -> list[dict[str, Any]]:
    """Chat messages as the rows the store keeps (`ConversationStore.extend` takes them)."""
    turns: list[dict[str, Any]] = []
    for message in messages:
        if message.get("reasoning_content"):  # a Responses answer's reasoning: an item of its own, first
            turns.append({"role": "assistant", "content": message["reasoning_content"], "reasoning": {"summary": []}})
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            turn = {"role": message["role"], "content": message.get("content") or ""}
            if IMAGE_PARTS in message:
                turn["parts"] = message[IMAGE_PARTS]
            if message["role"] == "tool":
                turn["tool_call_id"] = message["tool_call_id"]
            turns.append(turn)
        turns.extend({"role": "assistant", "content": "", "tool_call": _stored_call(call)} for call in calls)
    return turns


def check_call_ids(messages: ChatMessages, param: str = "messages") -> None:
    """400 for a call id that a stored conversation cannot keep (empty, or longer than its column)."""
    for i, message in enumerate(messages):
        named = [("tool_call_id", message.get("tool_call_id"))]
        named += [(f"tool_calls[{j}].id", call["id"]) for j, call in enumerate(message.get("tool_calls") or [])]
        for name, call_id in named:
            if call_id is not None and not 0 < len(call_id) <= MAX_CALL_ID_LENGTH:
                raise APIError(400, f"A stored conversation keeps call ids of 1 to {MAX_CALL_ID_LENGTH} characters.",
                               param=f"{param}[{i}].{name}")


def _stored_call(call: dict[str, Any]) -> dict[str, str]:
    return {"call_id": call["id"], "name": call["function"]["name"], "arguments": call["function"]["arguments"]}


def reply_message(content: str, tool_calls: list[dict[str, Any]] | None = None,
                  reasoning: str | None = None) -> dict[str, Any]:
    """An assistant's reply as a chat message: its text, its tool calls (OpenAI's chat tool_calls), and its
    reasoning (chat's `reasoning_content`)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = [{"id": call["id"], "type": "function", "function": {
            "name": call["function"]["name"], "arguments": call["function"]["arguments"]}} for call in tool_calls]
    return message


def chat_history(path: Sequence[Message]) -> ChatMessages:
    """Stored messages (oldest first) as the chat messages the template takes: a call joins the assistant message
    before it (one of text, or of earlier calls); reasoning is left out; stored "developer" turns read as "system",
    like new ones."""
    history: ChatMessages = []
    for message in path:
        if message.reasoning is not None:
            continue  # earlier turns' reasoning is left out, as chat templates and Responses input leave it
        if message.tool_call is not None:
            call = {"id": message.tool_call["call_id"], "type": "function",
                    "function": {"name": message.tool_call["name"], "arguments": message.tool_call["arguments"]}}
            last = history[-1] if history else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                history.append({"role": "assistant", "content": "", "tool_calls": [call]})
            continue
        entry: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                                 "content": message.content}
        if message.parts:
            entry[IMAGE_PARTS] = message.parts
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        history.append(entry)
    return history


# ---- OpenAI's items <-> stored rows -----------------------------------------------------------------------------


def item_turns(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI's items as rows to store: message items (their text, and where they hold images, their content parts
    as chat's stored image turns keep them), function calls and their outputs. 400 for anything else."""
    return [_item_turn(item, f"items[{i}]") for i, item in enumerate(items)]


def _item_turn(item: dict[str, Any], param: str) -> dict[str, Any]:
    kind = item.get("type", "message")
    if kind == "function_call":
        call = {name: _string(item, name, param) for name in ("call_id", "name", "arguments")}
        return {"role": "assistant", "content": "", "tool_call": call}
    if kind == "function_call_output":
        return {"role": "tool", "content": _output_text(item.get("output"), f"{param}.output"),
                "tool_call_id": _string(item, "call_id", param)}
    if kind == "reasoning":
        return _reasoning_turn(item, param)
    if kind != "message":
        raise unsupported(f"{param}.type", f"Stored conversations keep messages, function calls, their outputs and "
                                           f"reasoning: items of type {kind!r} are not supported.")
    role = item.get("role")
    if role not in ITEM_ROLES:
        raise APIError(400, f"role must be one of {', '.join(ITEM_ROLES)}.", param=f"{param}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise APIError(400, "content must be a string or a list of content parts.", param=f"{param}.content")
    parts = [_content_part(part, role, f"{param}.content[{j}]") for j, part in enumerate(content)]
    message: dict[str, Any] = {"role": role, "content": "".join(p["text"] for p in parts if p["type"] == "text")}
    if any(part["type"] == "image_url" for part in parts):
        message["parts"] = parts
    return message


def _reasoning_turn(item: dict[str, Any], param: str) -> dict[str, Any]:
    """A reasoning item as the row it is kept in: its text (its reasoning_text parts), its summary, and its
    encrypted content as sent."""
    summary = _parts(item.get("summary"), "summary_text", f"{param}.summary")
    content = _parts(item.get("content") or [], "reasoning_text", f"{param}.content")
    reasoning: dict[str, Any] = {"summary": [{"type": "summary_text", "text": part["text"]} for part in summary]}
    encrypted = item.get("encrypted_content")
    if encrypted is not None:
        if not isinstance(encrypted, str):
            raise APIError(400, "encrypted_content must be a string.", param=f"{param}.encrypted_content")
        reasoning["encrypted_content"] = encrypted
    return {"role": "assistant", "content": "".join(part["text"] for part in content), "reasoning": reasoning}


def _parts(parts: object, kind: str, param: str) -> list[dict[str, Any]]:
    if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") == kind
                                              and isinstance(p.get("text"), str) for p in parts):
        raise APIError(400, f"{param.rsplit('.', 1)[-1]} must be a list of {kind} parts.", param=param)
    return parts


def _string(item: dict[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or (name != "arguments" and not value):
        raise APIError(400, f"A {item['type']} item needs a string {name}.", param=f"{param}.{name}")
    if name == "call_id" and len(value) > MAX_CALL_ID_LENGTH:
        raise APIError(400, f"A call_id has at most {MAX_CALL_ID_LENGTH} characters.", param=f"{param}.{name}")
    return value


def _output_text(output: object, param: str) -> str:
    """A function call's output: its text, or its text parts joined (a tool's images are not kept)."""
    if isinstance(output, str):
        return output
    if isinstance(output, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS
                                        and isinstance(p.get("text"), str) for p in output):
        return "".join(part["text"] for part in output)
    raise APIError(400, "A function_call_output's output must be a string or a list of text parts.", param=param)


def _content_part(part: object, role: str, param: str) -> dict[str, Any]:
    """An item's content part as chat's: a text part, or an image_url part."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS:
        if not isinstance(part.get("text"), str):
            raise APIError(400, "A text content part needs a string 'text'.", param=f"{param}.text")
        return {"type": "text", "text": part["text"]}
    if kind != "input_image":
        raise unsupported(f"{param}.type", f"Content parts of type {kind!r} are not supported here (input_text, "
                                           "output_text, text and input_image).")
    if role != "user":
        raise APIError(400, "Only user messages hold images.", param=param)
    url, detail = part.get("image_url"), part.get("detail")
    if not isinstance(url, str) or not url.startswith(("data:", "http://", "https://")):
        raise unsupported(f"{param}.image_url", "An input_image is read from its image_url (a data: or http(s) "
                                                "URL) here, not a file_id.")
    if detail not in (None, "auto", "low", "high"):
        raise APIError(400, "detail must be 'auto', 'low' or 'high'.", param=f"{param}.detail")
    return {"type": "image_url", "image_url": {"url": url} | ({"detail": detail} if detail else {})}


def as_item(message: Message) -> dict[str, Any]:
    """A stored message as OpenAI's item: a function call, a function call's output, or a message item with its
    text (or its text and images, in order) as content parts."""
    if message.tool_call is not None:
        return {"type": "function_call", "id": message.id, "status": "completed", **message.tool_call}
    if message.tool_call_id is not None:
        return {"type": "function_call_output", "id": message.id, "status": "completed",
                "call_id": message.tool_call_id, "output": message.content}
    if message.reasoning is not None:
        item = {"type": "reasoning", "id": message.id, "status": "completed", **message.reasoning}
        return item | ({"content": [{"type": "reasoning_text", "text": message.content}]} if message.content else {})
    parts = message.parts or [{"type": "text", "text": message.content}]
    return {"type": "message", "id": message.id, "status": "completed", "role": message.role,
            "content": [_item_part(part, message.role) for part in parts]}


def _item_part(part: dict[str, Any], role: str) -> dict[str, Any]:
    if part["type"] == "image_url":
        return {"type": "input_image", "image_url": part["image_url"]["url"],
                "detail": part["image_url"].get("detail", "auto")}
    if role == "assistant":
        return {"type": "output_text", "text": part["text"], "annotations": [], "logprobs": []}
    return {"type": "input_text", "text": part["text"]}


# ---- the items' documented shapes --------------------------------------------------------------------------------


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputTextContent(_Response):
    type: Literal["input_text"]
    text: str


class OutputTextContent(_Response):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]]
    logprobs: list[dict[str, Any]]


class InputImageContent(_Response):
    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"]


class MessageItem(_Response):
    type: Literal["message"]
    id: str
    status: Literal["completed"]
    role: str
    content: list[InputTextContent | OutputTextContent | InputImageContent]


class FunctionCallItem(_Response):
    type: Literal["function_call"]
    id: str
    status: Literal["completed"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Response):
    type: Literal["function_call_output"]
    id: str
    status: Literal["completed"]
    call_id: str
    output: str


class TextPart(_Response):
    type: Literal["summary_text", "reasoning_text"]
    text: str


class ReasoningItem(_Response):
    type: Literal["reasoning"]
    id: str
    status: Literal["completed"]
    summary: list[TextPart]
    content: list[TextPart] | None = None
    encrypted_content: str | None = None


ConversationItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem
