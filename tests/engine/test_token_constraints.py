"""vLLM's `allowed_token_ids` and `bad_words` in the engine, offline through `LLM` on the tiny built-in
model: the exact tokens they leave, with overlapped scheduling on and off (a bad word of several tokens
reads the output so far), alongside a grammar and min_tokens, the choice that ends when a request's own
constraints leave nothing, bad values naming their parameter, and no leaked KV blocks."""

from __future__ import annotations

import pytest

from llmserve import LLM, SamplingParams
from llmserve.errors import InvalidRequestError
from llmserve.sampling.params import StructuredOutputsParams

PROMPT = "Once upon a time"


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "serial"])
def llm(request, tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=256, max_model_len=512,
               async_scheduling=request.param)


def _greedy(llm: LLM, max_tokens: int = 16, **kwargs) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)
    return list(llm.generate([PROMPT], params)[0].outputs[0].token_ids)


def _assert_pool_empty(llm: LLM) -> None:
    engine = llm.engine
    engine.check_invariants()
    bm = engine.core.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert engine.stats().num_unfinished_requests == 0


def _round_trip_pair(llm: LLM, tokens: list[int]) -> tuple[int, str]:
    """A position i whose tokens i, i + 1 decode to a text that encodes back to exactly those two, and
    that the earlier output does not already end the same way."""
    tokenizer = llm.get_tokenizer()
    for i in range(2, len(tokens) - 1):
        text = tokenizer.decode(tokens[i:i + 2])
        if tokenizer.encode(text.lstrip(), add_special_tokens=False) == tokens[i:i + 2] and tokens[i] not in tokens[:i]:
            return i, text
    raise AssertionError("no two-token word in the greedy output")


def test_allowed_token_ids_pick_the_best_allowed_token_every_step(llm):
    base = _greedy(llm)
    allowed = sorted(set(base[5:10]))
    constrained = _greedy(llm, allowed_token_ids=allowed)
    # The same choice by another route: the allowed tokens lifted by 100 (the tiny model's logits span less).
    assert constrained == _greedy(llm, logit_bias={t: 100.0 for t in allowed})
    assert set(constrained) <= set(allowed) and constrained != base
    sampled = llm.generate([PROMPT] * 3, [SamplingParams(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True,
                                                         allowed_token_ids=allowed, n=2) for s in range(3)])
    for out in sampled:
        for choice in out.outputs:
            assert set(choice.token_ids) <= set(allowed)
    # A request without them, in the same batch, is left alone.
    mixed = llm.generate([PROMPT, PROMPT], [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                                            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                           allowed_token_ids=allowed)])
    assert [list(o.outputs[0].token_ids) for o in mixed] == [base, constrained]
    _assert_pool_empty(llm)


def test_a_one_token_bad_word_is_never_produced(llm):
    base = _greedy(llm)
    word = llm.get_tokenizer().decode([base[3]])
    out = _greedy(llm, bad_words=[word])
    assert out[:3] == base[:3] and base[3] not in out
    assert out == _greedy(llm, logit_bias={base[3]: -100.0})
    for seed in range(4):
        sampled = llm.generate([PROMPT], SamplingParams(temperature=1.5, seed=seed, max_tokens=32, ignore_eos=True,
                                                         bad_words=[word], allowed_token_ids=sorted(set(base))))
        assert base[3] not in sampled[0].outputs[0].token_ids
    _assert_pool_empty(llm)


def test_a_two_token_bad_word_bans_its_end_only_after_its_start(llm):
    base = _greedy(llm, max_tokens=24)
    i, word = _round_trip_pair(llm, base)
    out = _greedy(llm, max_tokens=24, bad_words=[word])
    assert out[: i + 1] == base[: i + 1]  # its first token alone is allowed
    # The next token is the best one but the word's end, as with that token banned at that step alone.
    second = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=i + 2, ignore_eos=True, logprobs=2))
    top_two = sorted(second[0].outputs[0].logprobs[i + 1].items(), key=lambda kv: kv[1].rank)
    assert top_two[0][0] == base[i + 1] and out[i + 1] == top_two[1][0]
    for j in range(1, len(out)):
        assert out[j - 1: j + 1] != base[i: i + 2]
    _assert_pool_empty(llm)


def test_the_choice_ends_when_its_own_constraints_leave_no_token(llm):
    tokenizer = llm.get_tokenizer()
    eos = llm.engine.core.facts.eos_token_ids
    token = _greedy(llm)[0]
    for temperature in (0, 1.0):
        out = llm.generate([PROMPT], SamplingParams(temperature=temperature, seed=1, max_tokens=8,
                                                     allowed_token_ids=[token],
                                                     bad_words=[tokenizer.decode([token])]))[0].outputs[0]
        assert out.finish_reason == "stop" and len(out.token_ids) == 1 and out.token_ids[0] in eos
    # allowed_token_ids that a grammar never allows
    grammar = StructuredOutputsParams(choice=["alpha", "beta"])
    digits = [tokenizer.encode(d, add_special_tokens=False)[0] for d in "0123456789"]
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, structured_outputs=grammar,
                                                 allowed_token_ids=digits))[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == ""
    _assert_pool_empty(llm)


def test_allowed_token_ids_narrow_a_grammar_and_win_over_min_tokens(llm):
    tokenizer = llm.get_tokenizer()
    grammar = StructuredOutputsParams(choice=["yes", "red"])  # no token in common
    eos = sorted(llm.engine.core.facts.eos_token_ids)
    for word in ("yes", "red"):
        allowed = tokenizer.encode(word, add_special_tokens=False) + eos
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, structured_outputs=grammar,
                                                     allowed_token_ids=allowed))[0].outputs[0]
        assert out.text == word and out.finish_reason == "stop"
    # Only an end is allowed: it is sampled, min_tokens notwithstanding (as a grammar's end is).
    ended = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, min_tokens=4,
                                                   allowed_token_ids=eos))[0].outputs[0]
    assert ended.finish_reason == "stop" and len(ended.token_ids) == 1
    _assert_pool_empty(llm)


@pytest.mark.parametrize(
    ("params", "param"),
    [({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
     ({"allowed_token_ids": [True]}, "allowed_token_ids"), ({"bad_words": [5]}, "bad_words")],
)
def test_bad_values_name_the_parameter(params, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**params)
    assert info.value.param == param


@pytest.mark.parametrize(
    ("params", "message"),
    [({"allowed_token_ids": [1, 10**6]}, "below the vocabulary size"),
     ({"bad_words": ["fox " * 200]}, "at most 128 tokens")],
)
def test_values_the_model_cannot_take_name_the_parameter(llm, params, message):
    param = next(iter(params))
    with pytest.raises(InvalidRequestError, match=message) as info:
        llm.engine.add_request("bad", PROMPT, SamplingParams(**params))
    assert info.value.param == param
    _assert_pool_empty(llm)


def test_bad_words_are_tokenized_as_written_and_after_a_space(llm):
    tokenizer = llm.get_tokenizer()
    processor = llm.engine.input_processor
    expected = [tokenizer.encode("fox", add_special_tokens=False), tokenizer.encode(" fox", add_special_tokens=False)]
    assert expected[0] != expected[1]
    assert processor.bad_word_token_ids(["  fox", "fox"]) == expected
