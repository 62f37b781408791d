"""Reasoning in model output: `<think>…</think>` goes to `reasoning_content` (vLLM's field), the rest to content.

The `qwen3` parser decides, like vLLM's, from where the output starts:

* output that starts with `<think>`, or whose prompt already opened `<think>` (templates that put it
  in the generation prompt, e.g. Qwen3.5's or the thinking-only Qwen3 releases), is reasoning up to
  `</think>`, and content after it; with no `</think>` at all (the output was cut short) everything
  is reasoning;
* any other output is content, `<think>` tags and all (Qwen3 with `enable_thinking: false`, whose
  template closes an empty think block in the prompt, or a model that does not reason).

The choice depends only on text already seen, so streamed pieces always join up to the non-streamed
result; text that might still be the `<think>` or `</think>` tag is held back until it cannot be.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar, Protocol


class _Tokenizer(Protocol):
    def token_to_id(self, token: str) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """One streamed piece: reasoning text, content text, or both (reasoning first)."""

    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """Splits one output, fed in deltas, into reasoning and content."""

    def __init__(self, start: str, end: str, in_reasoning: bool) -> None:
        self._start = start
        self._end = end
        self._mode = "reasoning" if in_reasoning else "start"
        self._held = ""

    def feed(self, delta: str) -> ReasoningDelta:
        reasoning: list[str] = []
        content: list[str] = []
        for ch in delta:
            self._push(ch, reasoning, content)
        return ReasoningDelta("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningDelta:
        held, self._held = self._held, ""
        return ReasoningDelta(held, "") if self._mode == "reasoning" else ReasoningDelta("", held)

    @property
    def reasoning_ended(self) -> bool:
        """Whether the output has moved on to content (what follows is no longer reasoning)."""
        return self._mode == "content"

    def _push(self, ch: str, reasoning: list[str], content: list[str]) -> None:
        if self._mode == "content":
            content.append(ch)
            return
        held = self._held + ch
        if self._mode == "start":
            if held == self._start:
                self._mode, self._held = "reasoning", ""
            elif self._start.startswith(held):
                self._held = held
            else:
                self._mode, self._held = "content", ""
                content.append(held)
            return
        if held.endswith(self._end):
            reasoning.append(held[: -len(self._end)])
            self._mode, self._held = "content", ""
            return
        keep = next((size for size in range(min(len(held), len(self._end) - 1), 0, -1)
                     if self._end.startswith(held[-size:])), 0)
        reasoning.append(held[: len(held) - keep])
        self._held = held[len(held) - keep :]


class ReasoningParser(abc.ABC):
    """A model family's reasoning format: `parse` a whole output, or `stream` one."""

    name: ClassVar[str]
    start: ClassVar[str]
    end: ClassVar[str]

    def stream(self, prompt_opened: bool = False) -> ReasoningStream:
        """`prompt_opened`: the prompt ends inside an open reasoning block (see `prompt_opens_reasoning`)."""
        return ReasoningStream(self.start, self.end, prompt_opened)

    def parse(self, text: str, prompt_opened: bool = False) -> tuple[str | None, str | None]:
        """(reasoning, content), each None when empty."""
        stream = self.stream(prompt_opened)
        first, last = stream.feed(text), stream.finish()
        return (first.reasoning + last.reasoning) or None, (first.content + last.content) or None

    def prompt_opens_reasoning(self, prompt: str) -> bool:
        """Whether the rendered prompt leaves a reasoning block open (its last start tag is not closed)."""
        start = prompt.rfind(self.start)
        return start != -1 and prompt.find(self.end, start) == -1

    def end_token_ids(self, tokenizer: _Tokenizer) -> list[int]:
        """The token ids of the end tag, for structured output that starts after the reasoning
        (`StructuredOutputsParams.start_after`) and a thinking budget's forced end: one id when the tag is a token of
        its own (Qwen3), else its tokenization on its own, which a model may also spell differently."""
        return _tag_token_ids(tokenizer, self.end)

    def start_token_ids(self, tokenizer: _Tokenizer) -> list[int]:
        """The token ids of the start tag (where a thinking budget starts counting), as `end_token_ids`."""
        return _tag_token_ids(tokenizer, self.start)


def _tag_token_ids(tokenizer: _Tokenizer, tag: str) -> list[int]:
    token_id = tokenizer.token_to_id(tag)
    return [token_id] if token_id is not None else tokenizer.encode(tag, add_special_tokens=False)


class ReasoningTokens:
    """How many of a request's output tokens are reasoning (chat's `completion_tokens_details.reasoning_tokens`), as
    the parser reads their text: each choice's from its first token where the prompt opened the reasoning, else
    where it starts with the start tag's tokens, up to its end tag's tokens (counted) or its last token. Each choice
    is read on from where the last count left it, so counting as a reply streams costs its new tokens alone."""

    def __init__(self, start_ids: list[int], end_ids: list[int], prompt_opened: bool) -> None:
        self.start_ids = start_ids
        self.end_ids = end_ids
        self.prompt_opened = prompt_opened
        self._read: dict[object, tuple[int, int | None]] = {}  # a choice's key -> (tokens read, reasoning or None)

    def count(self, choice: object, token_ids: list[int]) -> int:
        """The reasoning tokens of `token_ids`, the output so far of the choice `choice` names."""
        read, found = self._read.get(choice, (0, None))
        if found is not None:
            return found
        if not self.prompt_opened:
            start = len(self.start_ids)
            if token_ids[:start] != self.start_ids[: len(token_ids)]:
                self._read[choice] = (read, 0)  # it does not start with the start tag: no reasoning
                return 0
            read = max(read, start)
        width = len(self.end_ids)
        for i in range(max(read - width + 1, 0 if self.prompt_opened else len(self.start_ids)),
                       len(token_ids) - width + 1):
            if token_ids[i : i + width] == self.end_ids:
                self._read[choice] = (i + width, i + width)
                return i + width
        self._read[choice] = (len(token_ids), None)
        return len(token_ids)


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    start = "<think>"
    end = "</think>"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {Qwen3ReasoningParser.name: Qwen3ReasoningParser}


def reasoning_parser(name: str) -> ReasoningParser:
    """The reasoning parser registered as `name`; ValueError listing the names otherwise."""
    parser = REASONING_PARSERS.get(name)
    if parser is None:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(REASONING_PARSERS))}")
    return parser()
