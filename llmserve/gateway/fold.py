"""A streamed chat completion's chunks, as its client got them, folded into the chat.completion they add up to
(what a `store: true` request keeps): each choice's content, reasoning, tool calls (their arguments joined),
logprobs, token ids and finish reason."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Chunk = dict[str, Any]


@dataclass
class _Choice:
    content: str = ""
    reasoning: str = ""
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # by the call's index
    logprobs: list[Any] | None = None
    token_ids: list[int] | None = None
    finish_reason: str | None = None

    def add(self, choice: Chunk) -> None:
        delta = choice.get("delta") or {}
        self.content += delta.get("content") or ""
        self.reasoning += delta.get("reasoning_content") or ""
        for call in delta.get("tool_calls") or ():
            self._add_call(call)
        if (logprobs := choice.get("logprobs")) is not None:
            self.logprobs = [*(self.logprobs or ()), *(logprobs.get("content") or ())]
        if (token_ids := choice.get("token_ids")) is not None:
            self.token_ids = [*(self.token_ids or ()), *token_ids]
        self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def _add_call(self, call: Chunk) -> None:
        whole = self.tool_calls.setdefault(int(call.get("index") or 0), {
            "id": None, "type": "function", "function": {"name": "", "arguments": ""}})
        whole["id"] = call.get("id") or whole["id"]
        function = call.get("function") or {}
        whole["function"]["name"] += function.get("name") or ""
        whole["function"]["arguments"] += function.get("arguments") or ""

    def as_choice(self, index: int) -> Chunk:
        calls = [self.tool_calls[i] for i in sorted(self.tool_calls)]
        # as a non-streamed reply: a message of tool calls alone has no content; no reasoning or calls, no fields
        message: Chunk = {"role": "assistant", "content": None if not self.content and calls else self.content}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if calls:
            message["tool_calls"] = calls
        choice = {"index": index, "message": message, "finish_reason": self.finish_reason,
                  "logprobs": {"content": self.logprobs} if self.logprobs is not None else None}
        if self.token_ids is not None:
            choice["token_ids"] = self.token_ids
        return choice


class ChatFold:
    """Folds chat.completion.chunk objects, in the order they were sent, into one chat.completion."""

    def __init__(self) -> None:
        self.envelope: Chunk = {}  # id, created, model: the last chunk's
        self.choices: dict[int, _Choice] = {}

    def add(self, chunk: Chunk) -> None:
        self.envelope = {name: chunk.get(name) for name in ("id", "created", "model")}
        for choice in chunk.get("choices") or ():
            self.choices.setdefault(int(choice.get("index") or 0), _Choice()).add(choice)

    def completion(self, usage: dict[str, Any]) -> Chunk:
        return {
            **self.envelope,
            "object": "chat.completion",
            "choices": [self.choices[i].as_choice(i) for i in sorted(self.choices)],
            "usage": usage,
            "system_fingerprint": None,
        }
