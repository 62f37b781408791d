"""OpenAI's Predicted Outputs in the engine: a request's `prediction` is drafted and verified as speculative tokens
are, so its output is token for token what it is without one (greedy, seeded sampling, n > 1, beside requests
without one under overlapped scheduling), taken where it agrees (fewer steps) and counted per choice.

The tiny Llama's random weights make byte tokens whose text does not tokenize back to them; its output is kept to
whole-word tokens (`allowed_token_ids`), so that a prediction written from an output's text has that output's
tokens."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from llmserve import LLM, SamplingParams
from llmserve.engine.prediction import draft_from_prediction
from llmserve.errors import InvalidRequestError
from llmserve.model.corpus import ENGLISH_WORDS

PROMPTS = ["Once upon a time", "The quick brown fox"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(model=str(tiny_llama_dir), dtype="float32")


@pytest.fixture(scope="module")
def words(llm: LLM) -> SamplingParams:
    """Greedy sampling of 64 whole-word tokens."""
    tokenizer = llm.engine.input_processor.tokenizer
    allowed = [ids[0] for word in ENGLISH_WORDS if len(ids := tokenizer.encode(" " + word, add_special_tokens=False)) == 1]
    return SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, allowed_token_ids=allowed)


def _run(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[list, int]:
    """The outputs, and the engine steps they took."""
    before = llm.engine.core.num_steps
    outputs = llm.generate(prompts, params)
    return outputs, llm.engine.core.num_steps - before


def test_the_output_is_unchanged_and_a_prediction_that_agrees_is_taken(llm: LLM, words: SamplingParams) -> None:
    (plain,), plain_steps = _run(llm, PROMPTS[:1], words)
    text, tokens = plain.outputs[0].text, plain.outputs[0].token_ids
    assert llm.engine.input_processor.tokenizer.encode(text, add_special_tokens=False) == tokens
    edited = text[:100] + " and then something new happened" + text[100:]
    found = {}
    for name, prediction in (("same", text), ("edited", edited), ("unrelated", "nothing alike at all")):
        (predicted,), steps = _run(llm, PROMPTS[:1], dataclasses.replace(words, prediction=prediction))
        choice = predicted.outputs[0]
        assert choice.token_ids == tokens and choice.text == text, name
        found[name] = (choice.accepted_prediction_tokens, choice.rejected_prediction_tokens, steps)
    # The first token is the prompt's; then drafts of 16 held whole, each with the model's token after them.
    assert found["same"] == (59, 0, plain_steps - 59)
    accepted, rejected, steps = found["edited"]
    assert accepted > 40 and rejected > 0 and steps < plain_steps - 40
    assert found["unrelated"][:2] == (0, 0)  # none of its tokens is in the output: nothing drafted


def test_seeded_sampling_and_choices_are_what_they_are_without_a_prediction(llm: LLM, words: SamplingParams) -> None:
    sampled = dataclasses.replace(words, temperature=0.9, seed=11, n=2)
    plain = llm.generate(PROMPTS[:1], sampled)[0]
    (predicted,), _ = _run(llm, PROMPTS[:1], dataclasses.replace(sampled, prediction=plain.outputs[1].text))
    assert [c.token_ids for c in predicted.outputs] == [c.token_ids for c in plain.outputs]
    assert predicted.outputs[1].accepted_prediction_tokens > 40  # the choice it was written from
    assert sum(c.accepted_prediction_tokens + c.rejected_prediction_tokens for c in predicted.outputs) > 0


def test_requests_with_and_without_one_share_overlapped_steps(llm: LLM, words: SamplingParams) -> None:
    assert llm.engine.core.overlapped  # async scheduling, the default: serial steps only while one predicts
    alone = [llm.generate([prompt], words)[0].outputs[0] for prompt in PROMPTS]
    both = llm.generate(PROMPTS, [dataclasses.replace(words, prediction=alone[0].text), words])
    assert [output.outputs[0].token_ids for output in both] == [choice.token_ids for choice in alone]
    assert both[0].outputs[0].accepted_prediction_tokens == 59
    assert llm.engine.core.scheduler.num_predicting == 0
    llm.engine.core.check_invariants()


def test_the_draft_follows_the_output_forward_through_the_prediction() -> None:
    prediction = np.array([5, 6, 7, 8, 5, 6, 9, 10], dtype=np.int64)
    assert draft_from_prediction(prediction, [5, 6], 0, 3) == ([7, 8, 5], 2)  # the first [5, 6]
    assert draft_from_prediction(prediction, [5, 6], 3, 3) == ([9, 10], 6)  # past the cursor: the second
    assert draft_from_prediction(prediction, [8, 5, 6], 0, 3) == ([9, 10], 6)  # the longest suffix found decides
    assert draft_from_prediction(prediction, [42], 2, 3) == ([], 2)  # lost: nothing until the output comes back


def test_a_prediction_that_cannot_be_is_refused(llm: LLM, words: SamplingParams) -> None:
    for params in (dataclasses.replace(words, prediction_token_ids=[1 << 40]),
                   dataclasses.replace(words, prediction="x " * 2100)):  # more tokens than the context's 2,048
        with pytest.raises(InvalidRequestError) as refused:
            llm.generate(PROMPTS[:1], params)
            assert refused.value.param == "prediction"
