"""Engine logprobs (per token: {token id: logprob} holding the chosen token and the top ones) in
OpenAI's two shapes: chat's `logprobs.content` list and the legacy completions arrays."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from llmserve.server.protocol import ChoiceLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from llmserve.tokenizer.tokenizer import Tokenizer

# JSON has no -inf: OpenAI-compatible servers report impossible tokens with this floor.
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return LOGPROB_FLOOR if math.isnan(logprob) or logprob < LOGPROB_FLOOR else logprob


class TokenTexts:
    """The text of single tokens, cached (the vocabulary is fixed)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=65536)(self._text)

    def _text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(token_ids)

    def utf8(self, token_id: int) -> list[int]:
        return list(self.text(token_id).encode("utf-8"))


def _top(entry: dict[int, float], top_n: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:top_n]


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[dict[int, float]], top_n: int, texts: TokenTexts
) -> ChoiceLogprobs:
    content = []
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        top = [
            TopLogprob(token=texts.text(t), logprob=_finite(lp), bytes=texts.utf8(t))
            for t, lp in _top(entry, top_n)
        ]
        content.append(
            TokenLogprob(
                token=texts.text(token_id),
                logprob=_finite(entry[token_id]),
                bytes=texts.utf8(token_id),
                top_logprobs=top,
            )
        )
    return ChoiceLogprobs(content=content)


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, float]],
    top_n: int,
    texts: TokenTexts,
    start_offset: int,
) -> CompletionLogprobs:
    result = CompletionLogprobs()
    offset = start_offset
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        text = texts.text(token_id)
        result.tokens.append(text)
        result.token_logprobs.append(_finite(entry[token_id]))
        result.top_logprobs.append({texts.text(t): _finite(lp) for t, lp in _top(entry, top_n)})
        result.text_offset.append(offset)
        offset += len(text)
    return result
