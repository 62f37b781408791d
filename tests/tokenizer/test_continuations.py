"""The continuation cache: a reply sent back as text is encoded as the tokens the engine generated."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmserve.model.builtin import IM_END_TOKEN
from llmserve.tokenizer.continuations import ContinuationCache
from llmserve.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_llama_dir)


def non_canonical_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """`text` spelled one character per token: decodes to `text`, yet differs from encode(text)."""
    ids = [tokenizer.encode(ch, add_special_tokens=False) for ch in text]
    assert all(len(piece) == 1 for piece in ids)
    spelled = [piece[0] for piece in ids]
    assert tokenizer.decode(spelled, skip_special_tokens=False) == text
    assert spelled != tokenizer.encode(text, add_special_tokens=False)
    return spelled


def render(tokenizer: Tokenizer, messages: list[dict[str, str]], generation_prompt: bool = True) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt)


def test_the_next_turn_is_encoded_with_the_generated_tokens(tokenizer: Tokenizer) -> None:
    cache = ContinuationCache(tokenizer)
    first = [{"role": "user", "content": "Hello there"}]
    prompt_text = render(tokenizer, first)
    prompt_ids = cache.encode(prompt_text)
    assert prompt_ids == tokenizer.encode(prompt_text, add_special_tokens=False)  # nothing remembered yet
    reply = "the weather"
    reply_ids = non_canonical_ids(tokenizer, reply)
    end_of_turn = tokenizer.token_to_id(IM_END_TOKEN)
    assert cache.remember(prompt_text, prompt_ids, reply, [*reply_ids, end_of_turn])
    second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "And tomorrow?"}]
    next_text = render(tokenizer, second)
    cut = len(prompt_text) + len(reply)
    assert next_text[:cut] == prompt_text + reply and next_text[cut:].startswith(IM_END_TOKEN)
    ids = cache.encode(next_text)
    assert ids == [*prompt_ids, *reply_ids, *tokenizer.encode(next_text[cut:], add_special_tokens=False)]
    assert ids[len(prompt_ids) + len(reply_ids)] == end_of_turn  # closed once, not twice
    assert tokenizer.decode(ids, skip_special_tokens=False) == next_text
    assert cache.hits == 1


def test_salted_prompts_and_replies_cut_by_stop_strings_are_kept_apart(tokenizer: Tokenizer) -> None:
    cache = ContinuationCache(tokenizer)
    prompt_text = render(tokenizer, [{"role": "user", "content": "Hi"}])
    prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)
    reply_ids = non_canonical_ids(tokenizer, "ok then")
    assert cache.remember(prompt_text, prompt_ids, "ok then", reply_ids, salt="alice")
    # A reply whose ids spell more than its text (a stop string cut it) is not remembered.
    assert not cache.remember(prompt_text, prompt_ids, "ok", reply_ids)
    next_text = render(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "ok then"},
                                   {"role": "user", "content": "Bye"}])
    canonical = tokenizer.encode(next_text, add_special_tokens=False)
    assert cache.encode(next_text) == canonical
    assert cache.encode(next_text, salt="bob") == canonical
    assert cache.encode(next_text, salt="alice")[: len(prompt_ids) + len(reply_ids)] == [*prompt_ids, *reply_ids]


def test_the_cache_forgets_the_least_recently_used(tokenizer: Tokenizer) -> None:
    cache = ContinuationCache(tokenizer, capacity=2)
    for i in range(3):
        text = f"prompt {i}"
        assert cache.remember(text, tokenizer.encode(text), "x", tokenizer.encode("x", add_special_tokens=False))
    assert len(cache) == 2
