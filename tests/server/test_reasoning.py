"""The qwen3 reasoning parser: reasoning/content split, streamed pieces equal the parse for every split."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from llmserve.server.reasoning import Qwen3ReasoningParser, ReasoningDelta, ReasoningTokens, reasoning_parser
from llmserve.tokenizer.tokenizer import Tokenizer

# (output, prompt opened <think>, reasoning, content)
SAMPLES: list[tuple[str, bool, str | None, str | None]] = [
    ("<think>\nThe user wants 2+2.\n</think>\n\n4", False, "\nThe user wants 2+2.\n", "\n\n4"),
    ("<think></think>Hello", False, None, "Hello"),
    ("Hello, no reasoning here.", False, None, "Hello, no reasoning here."),
    ("Step one, then two.</think>Answer: 3", True, "Step one, then two.", "Answer: 3"),
    ("<think>\nstill thinking when cut off", False, "\nstill thinking when cut off", None),
    ("cut off inside a prompt-opened block", True, "cut off inside a prompt-opened block", None),
    ("a </thin> is not </think>b<think>c</think>", True, "a </thin> is not ", "b<think>c</think>"),
    ("</think> without an opening is content", False, None, "</think> without an opening is content"),
    ("<thin", False, None, "<thin"),
    ("<think>ends in a partial tag </thi", False, "ends in a partial tag </thi", None),
    ("  <think>leading space means no reasoning</think>x", False, None, "  <think>leading space means no reasoning</think>x"),
    ("<think>日本語 🙂 reasoning</think>内容", False, "日本語 🙂 reasoning", "内容"),
    ("", False, None, None),
]


def _splits(text: str) -> list[list[str]]:
    rng = random.Random(len(text))
    chunkings = [[text], list(text)] + [[text[:cut], text[cut:]] for cut in range(1, len(text))]
    for _ in range(10):
        if len(text) > 1:
            cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 6))))
            chunkings.append([text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])])
    return chunkings


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), SAMPLES)
def test_parse(text: str, opened: bool, reasoning: str | None, content: str | None) -> None:
    assert Qwen3ReasoningParser().parse(text, prompt_opened=opened) == (reasoning, content)


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), SAMPLES)
def test_stream_equals_parse_for_every_split(text: str, opened: bool, reasoning: str | None, content: str | None) -> None:
    parser = Qwen3ReasoningParser()
    for chunks in _splits(text):
        stream = parser.stream(prompt_opened=opened)
        deltas = [stream.feed(chunk) for chunk in chunks] + [stream.finish()]
        assert ("".join(d.reasoning for d in deltas) or None, "".join(d.content for d in deltas) or None) == (
            reasoning,
            content,
        ), chunks
        # once content has begun, no reasoning follows
        kinds = [kind for d in deltas for kind in (("r",) if d.reasoning else ()) + (("c",) if d.content else ())]
        assert kinds == sorted(kinds, key=lambda kind: kind == "c")


def test_streaming_holds_back_only_a_possible_tag() -> None:
    stream = Qwen3ReasoningParser().stream()
    assert stream.feed("<thi") == ReasoningDelta()
    assert stream.feed("nk>Let me see </th") == ReasoningDelta(reasoning="Let me see ")
    assert not stream.reasoning_ended
    assert stream.feed("ere") == ReasoningDelta(reasoning="</there")
    assert stream.feed("</think>42") == ReasoningDelta(content="42")
    assert stream.reasoning_ended
    assert stream.finish() == ReasoningDelta()


def test_prompt_opens_reasoning() -> None:
    parser = Qwen3ReasoningParser()
    assert parser.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not parser.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not parser.prompt_opens_reasoning("<|im_start|>assistant\n")


def test_registry() -> None:
    assert isinstance(reasoning_parser("qwen3"), Qwen3ReasoningParser)
    with pytest.raises(ValueError, match="unknown reasoning parser 'deepseek_r1'; choose one of qwen3"):
        reasoning_parser("deepseek_r1")


def test_end_token_ids(tiny_qwen3_dir: Path) -> None:
    tokenizer = Tokenizer.from_pretrained(tiny_qwen3_dir)
    ids = Qwen3ReasoningParser().end_token_ids(tokenizer)
    assert ids == tokenizer.encode("</think>", add_special_tokens=False) and tokenizer.decode(ids) == "</think>"

    class SingleToken:
        def token_to_id(self, token: str) -> int | None:
            return 151668 if token == "</think>" else None

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            raise AssertionError("a tag that is one token is not encoded")

    assert Qwen3ReasoningParser().end_token_ids(SingleToken()) == [151668]


S, E1, E2 = 90, 91, 92  # a start tag of one token, an end tag of two


@pytest.mark.parametrize(("tokens", "opened", "reasoning"), [
    ([S, 1, 2, E1, E2, 3, 4], False, 5),  # the tags count
    ([1, 2, E1, E2, 3], True, 4),
    ([1, S, 2, E1, E2], False, 0),  # not starting with the start tag: no reasoning
    ([S, 1, 2, 3], False, 4),  # cut off while reasoning: all of it
    ([S, 1, E1, 2, E1, E2, E1, E2], False, 6),  # the first whole end tag ends it
    ([], False, 0),
    ([S], False, 1),
])
def test_reasoning_tokens_are_counted_as_the_parser_reads_the_text(tokens: list[int], opened: bool,
                                                                   reasoning: int) -> None:
    assert ReasoningTokens([S], [E1, E2], opened).count(0, tokens) == reasoning
    growing = ReasoningTokens([S], [E1, E2], opened)  # counted as the reply streams, every token and at once
    assert [growing.count("a", tokens[:i]) for i in range(len(tokens) + 1)][-1] == reasoning
    assert ReasoningTokens([S], [E1, E2], opened).count("b", tokens) == reasoning
    split = ReasoningTokens([S], [E1, E2], opened)
    split.count("c", tokens[:3])
    assert split.count("c", tokens) == reasoning  # an end tag across two reads
