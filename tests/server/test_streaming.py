"""The streamed chunks' fast encoders give the protocol models' JSON byte for byte."""

from __future__ import annotations

import random

import pytest

from llmserve.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    CompletionChoice,
    CompletionResponse,
    DeltaMessage,
    Usage,
)
from llmserve.server.streaming import ChunkEnvelope, content_choice_json, sse, text_choice_json

TEXTS = ["", " than", 'quote " and \\ backslash', "new\nline\ttab", "\x00\x1f\x7f", "日本語 café", "\u2028\u2029",
         "emoji 🙂", "</script>"]


def _random_texts(count: int) -> list[str]:
    rng = random.Random(0)
    pools = [(0, 0x80), (0x80, 0xD7FF), (0xE000, 0x10FFFF)]
    return ["".join(chr(rng.randrange(*rng.choice(pools))) for _ in range(rng.randrange(9))) for _ in range(count)]


@pytest.mark.parametrize("finish_reason", [None, "stop", "length", "content_filter"])
def test_choices_match_the_models(finish_reason):
    for text in TEXTS + _random_texts(300):
        expected = CompletionChoice(index=2, text=text, finish_reason=finish_reason).model_dump_json()
        assert text_choice_json(2, text, finish_reason) == expected
        delta = DeltaMessage(content=text or None)
        expected = ChatChunkChoice(index=1, delta=delta, finish_reason=finish_reason).model_dump_json()
        assert content_choice_json(1, text, finish_reason) == expected


def test_envelopes_match_whole_chunks():
    choice = CompletionChoice(index=0, text="hi", finish_reason=None)
    envelope = ChunkEnvelope(CompletionResponse(id="cmpl-1", created=7, model="m", choices=[], usage=None))
    whole = sse(CompletionResponse(id="cmpl-1", created=7, model="m", choices=[choice, choice], usage=None))
    assert envelope.event([text_choice_json(0, "hi", None), choice]) == whole
    chat = ChatChunkChoice(index=0, delta=DeltaMessage(content="hi"), finish_reason="stop")
    envelope = ChunkEnvelope(ChatCompletionChunk(id="chatcmpl-1", created=7, model="m", choices=[]))
    assert envelope.event([content_choice_json(0, "hi", "stop")]) == sse(
        ChatCompletionChunk(id="chatcmpl-1", created=7, model="m", choices=[chat]))
    usage = Usage.of(5, 2, 1)
    assert envelope.event([content_choice_json(0, "hi", "stop")], usage) == sse(
        ChatCompletionChunk(id="chatcmpl-1", created=7, model="m", choices=[chat], usage=usage))
    with pytest.raises(ValueError):
        ChunkEnvelope(ChatCompletionChunk(id="x", created=7, model="m", choices=[chat]))
