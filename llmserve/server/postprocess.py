"""What a chat choice's generated text becomes in the assistant message.

Between the text a choice's stream cursor releases (stop strings and the safety guard already
applied) and the rendered message may sit one `TextPostProcessor` per choice: a tool-call or
reasoning parser, splitting the text into `content`, `reasoning_content` and `tool_calls` pieces and
holding back what it cannot place yet. The chat endpoint renders the pieces as the message
(non-streamed) or as OpenAI deltas (streamed) without knowing which parser made them. A choice without
one sends its text as content (the streaming hot path: nothing is allocated per token for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class MessagePieces:
    """Fields to add to an assistant message; empty ones add nothing."""

    content: str = ""
    reasoning_content: str = ""
    # OpenAI's tool call objects as the delta carries them: {"index", "id", "type", "function": {"name",
    # "arguments"}}, a call's id and name in its first piece and its arguments possibly in several.
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def is_content_only(self) -> bool:
        return not self.reasoning_content and not self.tool_calls

    @property
    def is_empty(self) -> bool:
        return not self.content and self.is_content_only

    def extend(self, more: MessagePieces) -> MessagePieces:
        """These pieces followed by `more` (in place; returns self)."""
        self.content += more.content
        self.reasoning_content += more.reasoning_content
        self.tool_calls.extend(more.tool_calls)
        return self


class TextPostProcessor(Protocol):
    """Turns one choice's released text, fed in order, into message pieces."""

    def feed(self, text: str) -> MessagePieces:
        """The pieces `text` (the newly released part) completes; text it cannot place yet is held."""
        ...

    def finish(self, finish_reason: str) -> tuple[MessagePieces, str]:
        """The choice ended: what was held, and the finish reason to report (e.g. "tool_calls" for a
        "stop" that ended a tool call)."""
        ...
