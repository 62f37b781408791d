"""The chat shape's post-processor hook: what a per-choice post-processor makes of the released text is
what the client gets, streamed as deltas and whole in the message; without one, the fast encoder."""

from __future__ import annotations

import json

from llmserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmserve.server.chat import ChatChoiceRenderer
from llmserve.server.postprocess import MessagePieces
from llmserve.server.protocol import ChatChunkChoice, DeltaMessage
from llmserve.server.streaming import Delta

CALL = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


class ThinkThenCall:
    """A stand-in for a reasoning + tool-call parser: text is reasoning, held back while it ends in
    "<", and the end of the choice is a tool call."""

    def __init__(self) -> None:
        self.held = ""

    def feed(self, text: str) -> MessagePieces:
        text = self.held + text
        self.held = "<" if text.endswith("<") else ""
        return MessagePieces(reasoning_content=text.removesuffix(self.held))

    def finish(self, finish_reason: str) -> tuple[MessagePieces, str]:
        return MessagePieces(reasoning_content=self.held, tool_calls=[CALL]), "tool_calls"


def _output(completion: CompletionOutput) -> RequestOutput:
    return RequestOutput("r", None, [1], [completion], completion.finished, RequestMetrics(0.0))


def _renderer(processor, echo: str = "") -> ChatChoiceRenderer:
    return ChatChoiceRenderer(2, None, texts=None, echo=echo, processor=processor)  # type: ignore[arg-type]


def _stream(renderer: ChatChoiceRenderer, pieces: list[tuple[str, str | None]]) -> list[dict | None]:
    completion = CompletionOutput(index=2, text="", token_ids=[])
    chunks = []
    for text, finish_reason in pieces:
        choice = renderer.chunk_choice(Delta(text, [7], None, finish_reason), _output(completion))
        chunks.append(None if choice is None else json.loads(choice if isinstance(choice, str) else choice.model_dump_json()))
    return chunks


def test_plain_content_streams_through_the_fast_encoder():
    renderer = _renderer(None)
    choice = renderer.chunk_choice(Delta(" hi", [7], None, None), _output(CompletionOutput(2, " hi", [7])))
    assert isinstance(choice, str)
    assert choice == ChatChunkChoice(index=2, delta=DeltaMessage(content=" hi")).model_dump_json()
    assert _stream(renderer, [("", "stop")]) == [{"index": 2, "delta": {}, "logprobs": None, "finish_reason": "stop"}]


def test_a_post_processor_renders_streamed_deltas():
    chunks = _stream(_renderer(ThinkThenCall()), [("a", None), ("b<", None), ("c", None), ("", "stop")])
    assert chunks == [
        {"index": 2, "delta": {"reasoning_content": "a"}, "logprobs": None, "finish_reason": None},
        {"index": 2, "delta": {"reasoning_content": "b"}, "logprobs": None, "finish_reason": None},
        {"index": 2, "delta": {"reasoning_content": "<c"}, "logprobs": None, "finish_reason": None},
        {"index": 2, "delta": {"tool_calls": [CALL]}, "logprobs": None, "finish_reason": "tool_calls"},
    ]


def test_held_back_text_sends_nothing_until_placed():
    assert _stream(_renderer(ThinkThenCall()), [("<", None), ("", "stop")]) == [
        None,
        {"index": 2, "delta": {"reasoning_content": "<", "tool_calls": [CALL]}, "logprobs": None,
         "finish_reason": "tool_calls"},
    ]


def test_a_post_processor_renders_the_whole_message():
    completion = CompletionOutput(index=2, text="ab<c", token_ids=[7, 8], finish_reason="stop")
    choice = _renderer(ThinkThenCall()).response_choice(completion, "ab<c", "stop", _output(completion))
    assert choice.model_dump() == {
        "index": 2,
        "message": {  # the non-streamed message's calls are whole, without a delta's index
            "role": "assistant", "content": None, "reasoning_content": "ab<c",
            "tool_calls": [{key: value for key, value in CALL.items() if key != "index"}],
        },
        "logprobs": None,
        "finish_reason": "tool_calls",
    }


def test_plain_content_messages_keep_their_shape():
    completion = CompletionOutput(index=2, text=" there", token_ids=[7], finish_reason="length")
    choice = _renderer(None, echo="Hi").response_choice(completion, " there", "length", _output(completion))
    assert choice.model_dump() == {
        "index": 2,
        "message": {"role": "assistant", "content": "Hi there"},
        "logprobs": None,
        "finish_reason": "length",
    }
