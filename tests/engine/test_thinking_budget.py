"""A thinking budget (`SamplingParams.thinking_budget`, vLLM's `thinking_token_budget`): the reasoning section's
state token by token, then the engine on the cycling tiny Llama (tests/cycling_model.py), whose greedy output is known:
the first `max_tokens` tokens of the section are the model's own, its end tokens follow them forced, and the rest is
exactly what the model writes after that text; a section that ends in time, or never opens, is left as it was. Steps
overlapped or speculating, n > 1 and a grammar after the reasoning give the same, and no block leaks."""

from __future__ import annotations

import numpy as np
import pytest

from llmserve import LLM, SamplingParams
from llmserve.engine.thinking import ThinkingBudget
from llmserve.errors import InvalidRequestError
from llmserve.sampling.params import StructuredOutputsParams, ThinkingBudgetParams

PROMPT = "The quick brown fox"
LENGTH = 32


def _allowed(state: ThinkingBudget, vocab: int = 64) -> list[int]:
    bitmask = np.full((1, (vocab + 31) // 32), -1, dtype=np.int32)
    state.fill_bitmask(bitmask, 0)
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")
    return [int(t) for t in np.flatnonzero(bits[:vocab])]


def _follow(state: ThinkingBudget, tokens: list[int]) -> ThinkingBudget:
    for token in tokens:
        state.accept(token)
    return state


# ---- the section's state -------------------------------------------------------------------------------------------
def test_the_end_is_forced_once_the_budget_is_spent_then_nothing_is():
    state = _follow(ThinkingBudget(ThinkingBudgetParams(3, end=[40, 41])), [1, 2])
    assert not state.constrains and state.spent == 2
    state.accept(3)
    assert state.constrains and _allowed(state) == [40]
    state.accept(40)
    assert state.constrains and _allowed(state) == [41]
    state.accept(41)
    assert not state.constrains and state.closed and state.done and state.spent == 3


def test_an_end_written_in_time_closes_the_section_unforced():
    state = _follow(ThinkingBudget(ThinkingBudgetParams(5, end=[40, 41])), [1, 40, 41])
    assert state.closed and state.done and not state.constrains and state.spent == 3
    assert not _follow(state, [7, 8, 9, 10, 11]).constrains


def test_an_end_begun_when_the_budget_runs_out_is_finished_not_started_again():
    state = _follow(ThinkingBudget(ThinkingBudgetParams(2, end=[40, 41, 42])), [1, 40])
    assert _allowed(state) == [41]
    assert _follow(state, [41, 42]).closed


def test_a_zero_budget_forces_the_end_at_once_and_a_start_opens_the_section():
    assert _allowed(ThinkingBudget(ThinkingBudgetParams(0, end=[40]))) == [40]
    state = ThinkingBudget(ThinkingBudgetParams(1, end=[40], start=[30, 31]))
    assert not _follow(state, [30]).constrains and not state.opened
    assert not _follow(state, [31]).constrains and state.opened and state.spent == 0
    assert _allowed(_follow(state, [5])) == [40]


def test_output_that_does_not_start_with_the_start_has_no_section():
    state = _follow(ThinkingBudget(ThinkingBudgetParams(1, end=[40], start=[30, 31])), [30, 5])
    assert state.closed and state.done
    assert not _follow(state, [30, 31, 1, 2, 3]).constrains  # a start later on is only text


def test_a_pending_token_holds_the_next_step_back_only_where_it_may_decide_the_next_token():
    state = _follow(ThinkingBudget(ThinkingBudgetParams(5, end=[40])), [1, 2])
    assert not state.waits_for(0) and not state.waits_for(2)  # 4 of 5: the next one is the model's own anyway
    assert state.waits_for(3)  # the budget may be spent by then
    assert ThinkingBudget(ThinkingBudgetParams(5, end=[40], start=[30])).waits_for(1)  # may open the section
    assert not _follow(state, [40]).waits_for(1)  # closed


def test_bad_budgets_are_400s_naming_the_field():
    for budget in (ThinkingBudgetParams(-1, end=[1]), ThinkingBudgetParams(1, end=[]),
                   ThinkingBudgetParams(1, end=[1], start=[-2])):
        with pytest.raises(InvalidRequestError) as refused:
            SamplingParams(thinking_budget=budget)
        assert refused.value.param == "thinking_budget"
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(use_beam_search=True, n=2, temperature=0, thinking_budget=ThinkingBudgetParams(1, end=[1]))
    assert refused.value.param == "thinking_budget"


# ---- the engine ----------------------------------------------------------------------------------------------------
def _llm(model_dir, **options) -> LLM:
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=128, max_model_len=512, **options)


@pytest.fixture(scope="module")
def plain(cycling_llama_dir) -> LLM:
    return _llm(cycling_llama_dir)


@pytest.fixture(scope="module")
def free_run(plain: LLM) -> list[int]:
    """The model's own greedy output."""
    (out,) = plain.generate([PROMPT], SamplingParams(temperature=0, max_tokens=LENGTH, ignore_eos=True))
    return out.outputs[0].token_ids


def _greedy(llm: LLM, budget: ThinkingBudgetParams, **options) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=LENGTH, ignore_eos=True, thinking_budget=budget, **options)
    (out,) = llm.generate([PROMPT], params)
    return [choice.token_ids for choice in out.outputs]


def _after(llm: LLM, head: list[int], count: int) -> list[int]:
    """What the model writes after the prompt and `head`, unconstrained."""
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    (out,) = llm.generate([{"prompt_token_ids": prompt_ids + head}],
                          SamplingParams(temperature=0, max_tokens=count, ignore_eos=True))
    return out.outputs[0].token_ids


def _end(free_run: list[int]) -> list[int]:
    """Two tokens the model does not write itself."""
    return [token for token in range(1000, 1100) if token not in free_run][:2]


def _assert_pool_empty(llm: LLM) -> None:
    llm.engine.check_invariants()
    bm = llm.engine.core.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_the_budget_cuts_the_models_reasoning_and_it_goes_on_after_the_forced_end(plain, free_run):
    end = _end(free_run)
    for budget, head in ((ThinkingBudgetParams(3, end), free_run[:3] + end),
                         (ThinkingBudgetParams(2, end, start=free_run[:1]), free_run[:3] + end),
                         (ThinkingBudgetParams(0, end), end)):
        (got,) = _greedy(plain, budget)
        assert got == head + _after(plain, head, LENGTH - len(head)), budget
    _assert_pool_empty(plain)


def test_a_section_that_ends_in_time_or_never_opens_is_the_models_own_output(plain, free_run):
    end = _end(free_run)
    assert _greedy(plain, ThinkingBudgetParams(8, free_run[2:3])) == [free_run]  # its end comes third
    assert _greedy(plain, ThinkingBudgetParams(1, end, start=end[:1])) == [free_run]  # it does not start so
    (got,) = _greedy(plain, ThinkingBudgetParams(3, [free_run[2], end[1]]))  # the end's first token comes third
    head = free_run[:3] + end[1:]
    assert got == head + _after(plain, head, LENGTH - len(head))
    _assert_pool_empty(plain)


def test_speculating_and_stepping_one_at_a_time_give_the_same_tokens(cycling_llama_dir, plain, free_run):
    end = _end(free_run)
    budget = ThinkingBudgetParams(5, end)
    expected = _greedy(plain, budget)
    for options in ({"async_scheduling": False},
                    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}}):
        llm = _llm(cycling_llama_dir, **options)
        assert _greedy(llm, budget) == expected, options
        _assert_pool_empty(llm)
    assert llm.engine.core.stats().spec_decode.num_drafts > 0  # once the section closed, the cycle is drafted


def test_every_choice_of_n_has_its_own_section(plain, free_run):
    end = _end(free_run)
    params = SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=LENGTH, ignore_eos=True,
                            thinking_budget=ThinkingBudgetParams(4, end))
    (out,) = plain.generate([PROMPT], params)
    for choice in out.outputs:
        assert choice.token_ids[4:6] == end and end[0] not in choice.token_ids[:4]
    _assert_pool_empty(plain)


def test_a_grammar_after_the_reasoning_starts_at_the_forced_end(plain, free_run):
    end = _end(free_run)
    params = SamplingParams(temperature=0, max_tokens=LENGTH, thinking_budget=ThinkingBudgetParams(3, end),
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"], start_after=end))
    (out,) = plain.generate([PROMPT], params)
    tokens = out.outputs[0].token_ids
    assert tokens[:5] == free_run[:3] + end
    assert plain.get_tokenizer().decode(tokens[5:], skip_special_tokens=True) in ("yes", "no")
    assert out.outputs[0].finish_reason == "stop"
    _assert_pool_empty(plain)
