"""Engine logprobs (per token: {token id: Logprob} holding the chosen token and the top ones) in
OpenAI's two shapes, chat's `logprobs.content` list and the legacy completions arrays (with `echo`,
the prompt's tokens first), and in vLLM's `prompt_logprobs` shape."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from llmserve.outputs import Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from llmserve.server.protocol import (
    ChoiceLogprobs,
    CompletionLogprobs,
    PromptTokenLogprob,
    TokenLogprob,
    TopLogprob,
)
from llmserve.tokenizer.tokenizer import Tokenizer

# JSON has no -inf: OpenAI-compatible servers report impossible tokens with this floor.
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return LOGPROB_FLOOR if math.isnan(logprob) or logprob < LOGPROB_FLOOR else logprob


class TokenTexts:
    """The text of single tokens, cached (the vocabulary is fixed)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=65536)(self._text)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def utf8(self, token_id: int) -> list[int]:
        """The token's bytes (OpenAI's `bytes`): a piece of a character is its own bytes, not U+FFFD's."""
        return list(self.tokenizer.token_bytes(token_id))


class TokenIdTexts(TokenTexts):
    """vLLM's `return_tokens_as_token_ids`: logprobs name each token `token_id:{id}`, which tells apart
    tokens whose own text does not (a piece of a UTF-8 character decodes to U+FFFD)."""

    def _text(self, token_id: int) -> str:
        return f"token_id:{token_id}"


def logprob_texts(texts: TokenTexts, as_token_ids: bool) -> TokenTexts:
    """How a request's logprobs name tokens: by their text, or by their id."""
    return TokenIdTexts(texts.tokenizer) if as_token_ids else texts


def _top(entry: dict[int, Logprob], top_n: int) -> list[tuple[int, float]]:
    return sorted(((t, lp.logprob) for t, lp in entry.items()), key=lambda item: -item[1])[:top_n]


def chat_logprobs(
    token_ids: Sequence[int], logprobs: SampleLogprobs, top_n: int, texts: TokenTexts
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
                logprob=_finite(entry[token_id].logprob),
                bytes=texts.utf8(token_id),
                top_logprobs=top,
            )
        )
    return ChoiceLogprobs(content=content)


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[dict[int, Logprob] | None],
    top_n: int,
    texts: TokenTexts,
    start_offset: int,
) -> CompletionLogprobs:
    """The legacy arrays; a position without logprobs (the prompt's first token) has nulls."""
    result = CompletionLogprobs()
    offset = start_offset
    for token_id, entry in zip(token_ids, logprobs, strict=False):
        text = texts.text(token_id)
        result.tokens.append(text)
        if entry is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            result.token_logprobs.append(_finite(entry[token_id].logprob))
            result.top_logprobs.append({texts.text(t): _finite(lp) for t, lp in _top(entry, top_n)})
        result.text_offset.append(offset)
        offset += len(text)
    return result


def echoed_completion_logprobs(
    output: RequestOutput, token_ids: Sequence[int], logprobs: SampleLogprobs, top_n: int, texts: TokenTexts
) -> CompletionLogprobs:
    """`echo` with `logprobs`: the prompt's tokens (the first with null logprobs, as OpenAI and vLLM
    report it), then the generated ones, text offsets counted from the prompt's first token."""
    prompt_logprobs = output.prompt_logprobs
    assert prompt_logprobs is not None, "echo with logprobs asks the engine for prompt logprobs"
    return completion_logprobs(
        [*output.prompt_token_ids, *token_ids], [*prompt_logprobs, *logprobs], top_n, texts, 0
    )


def vllm_prompt_logprobs(
    prompt_logprobs: PromptLogprobs | None, top_n: int | None
) -> list[dict[int, PromptTokenLogprob] | None] | None:
    """vLLM's `prompt_logprobs` response field: per prompt token, its own Logprob and the top `top_n`."""
    if prompt_logprobs is None or top_n is None:
        return None
    result: list[dict[int, PromptTokenLogprob] | None] = [None]
    for entry in prompt_logprobs[1:]:
        assert entry is not None
        own = next(iter(entry))  # the prompt token's entry comes first
        result.append({
            token_id: PromptTokenLogprob(
                logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token
            )
            for token_id, lp in entry.items()
            if token_id == own or (lp.rank is not None and lp.rank <= top_n)
        })
    return result
