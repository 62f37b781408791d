"""Speculative decoding by n-gram lookup (vLLM's `ngram` method): the drafts a sequence's own text proposes
are verified in one step, and what comes out is token for token what decoding one token at a time gives
(greedy, seeded sampling with penalties, stops, limits, n > 1, preemption, prefix-cache hits), with every
block accounted for.

The engine tests use a crafted tiny Llama that repeats a cycle of 7 tokens (its lm_head maps each token's
embedding to the next token of its cycle, its attention and MLP outputs scaled down but not off), so drafts
are long and mostly right, as on repetitive text; the scheduler tests give the tokens by hand."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from llmserve import LLM, SamplingParams
from llmserve.config import EngineConfig, SpeculativeConfig, parse_speculative_config
from llmserve.engine.block_manager import BlockManager
from llmserve.engine.ngram_proposer import NgramProposer
from llmserve.engine.scheduler import Scheduler
from llmserve.model import cpu_linear
from llmserve.model.runner import ModelOutput
from tests.engine.steps import add, step

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = ["The quick brown fox", "Once upon a time", "def fibonacci(n):", "In a distant galaxy, far away"]


# ---- the proposer and the config ------------------------------------------------------------------------------
def _proposer(k: int = 3, low: int = 1, high: int = 3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(k, low, high))


def test_the_longest_earlier_ngram_proposes_what_followed_it():
    proposer = _proposer(k=3, low=1, high=3)
    # [7, 8, 9] occurred at 1, [9] alone also at 5: the longer match wins.
    assert proposer.propose([1, 7, 8, 9, 4, 9, 2, 7, 8, 9], 10) == [4, 9, 2]
    assert proposer.propose([1, 7, 8, 9, 4, 9, 2, 7, 8, 9], 2) == [4, 9]  # the caller's limit
    assert proposer.propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert _proposer(low=2).propose([5, 1, 6, 2, 1], 3) == []  # a 1-gram match is below prompt_lookup_min


def test_a_short_period_proposes_from_an_occurrence_with_enough_tokens_after_it():
    # The latest [1, 2] (at 4) has one token after it; the one before (at 2) has three.
    assert _proposer(k=3, low=2, high=2).propose([1, 2, 1, 2, 1, 2], 3) == [1, 2, 1]
    assert _proposer(k=3, low=1, high=1).propose([5, 5, 5], 3) == [5]  # none has enough: the latest


def test_speculative_config_takes_vllms_form_and_names_what_it_refuses():
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4}) == SpeculativeConfig(4, 5, 5)
    assert parse_speculative_config({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 3}) == (
        SpeculativeConfig(2, 3, 3)
    )
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 8}) == (
        SpeculativeConfig(2, 5, 5, disable_by_batch_size=8)
    )
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": None}) == (
        SpeculativeConfig(2, 5, 5)
    )
    for bad, named in (
        ({"method": "eagle", "num_speculative_tokens": 3}, "'eagle' is not supported"),
        ({"method": "medusa", "model": "m", "num_speculative_tokens": 3}, "'medusa' is not supported"),
        ({"method": "ngram"}, "num_speculative_tokens must be a positive integer"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceeds"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "draft_tensor_parallel_size"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ):
        with pytest.raises(ValueError, match=named):
            EngineConfig(model="m", speculative_config=bad).validate()


# ---- the scheduler ----------------------------------------------------------------------------------------------
def _scheduler(
    num_blocks: int = 64, budget: int = 64, k: int = 3, disable_by_batch_size: int | None = None,
    fast_step_tokens: int | None = None, strict_fast_step: bool = False,
) -> Scheduler:
    proposer = NgramProposer(SpeculativeConfig(k, 1, 3, disable_by_batch_size=disable_by_batch_size))
    return Scheduler(BlockManager(num_blocks, 4), max_num_batched_tokens=budget, max_num_seqs=8, proposer=proposer,
                     fast_step_tokens=fast_step_tokens, strict_fast_step=strict_fast_step)


def _verify(sched: Scheduler, sampled: list[int]):
    out = sched.schedule()
    return out, sched.update_from_output(out, ModelOutput(sampled))


def test_drafts_are_accepted_up_to_the_first_token_the_model_did_not_sample():
    sched = _scheduler()
    seq = add(sched, [5, 6, 7, 8, 5, 6])
    step(sched, token=7)  # the prompt, then 7: [..., 5, 6, 7] occurred at 0, followed by 8, 5, 6
    out = sched.schedule()
    # Its token's row, then a decode row for each draft at its position; one sample target verifying them.
    assert [(row.begin, row.num_new, row.draft) for row in out.rows] == [(6, 1, -1), (7, 1, 8), (8, 1, 5), (9, 1, 6)]
    assert out.samples[0].drafts == (8, 5, 6) and seq.num_computed_tokens == 10
    outputs = sched.update_from_output(out, ModelOutput([8, 5, 9, 1]))  # 8 and 5 accepted, then the model's 9
    assert [o.token_id for o in outputs] == [8, 5, 9]
    assert seq.token_ids[7:] == [8, 5, 9] and seq.num_computed_tokens == 9 and seq.num_uncomputed_tokens == 1
    assert (sched.spec.num_drafts, sched.spec.num_draft_tokens, sched.spec.num_accepted_tokens) == (1, 3, 2)
    assert sched.spec.accepted_per_position == [1, 1, 0]
    sched.block_manager.check_invariants(sched.live_sequences())


def test_a_draft_accepted_whole_adds_the_models_next_token_too():
    sched = _scheduler()
    seq = add(sched, [5, 6, 7, 8, 5, 6])
    step(sched, token=7)
    _, outputs = _verify(sched, [8, 5, 6, 7])
    assert [o.token_id for o in outputs] == [8, 5, 6, 7] and seq.num_computed_tokens == 10
    assert sched.spec.accepted_per_position == [1, 1, 1]


def test_a_stop_token_among_the_accepted_ends_the_sequence_there_and_frees_its_blocks():
    sched = _scheduler()
    seq = add(sched, [5, 6, 7, 8, 5, 6], params=SamplingParams(max_tokens=None, stop_token_ids=[5]))
    step(sched, token=7)
    _, outputs = _verify(sched, [8, 5, 6, 7])
    assert [o.token_id for o in outputs] == [8, 5] and outputs[-1].finish_reason == "stop"
    assert seq.is_finished and not sched.has_unfinished()
    sched.block_manager.check_invariants([])
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_the_prompts_last_token_has_no_drafts_so_an_n_2_request_forks_as_ever():
    sched = _scheduler(budget=5)
    add(sched, [5, 6, 7, 5, 6, 7], params=SamplingParams(max_tokens=None, n=2))
    step(sched)  # five of the prompt's tokens
    out = sched.schedule()
    assert (len(out.rows), out.rows[0].num_new, [t.drafts for t in out.samples]) == (1, 1, [(), ()])


def test_a_draft_that_misses_pauses_speculation_and_shortens_the_next_one():
    sched = _scheduler()
    seq = add(sched, [5, 6, 7, 8, 5, 6])
    step(sched, token=7)
    _, outputs = _verify(sched, [5, 0, 0, 0])  # the model's 5 instead of the draft's 8: nothing accepted
    assert [o.token_id for o in outputs] == [5] and (seq.draft_pause, seq.draft_limit) == (1, 1)
    out = sched.schedule()
    assert out.samples[0].drafts == ()  # a step without, though [5] occurred before
    sched.update_from_output(out, ModelOutput([6]))
    out = sched.schedule()
    assert out.samples[0].drafts == (7,)  # [5, 6] occurred before, followed by 7, 8, ...: one draft token
    sched.update_from_output(out, ModelOutput([7, 8]))
    assert seq.draft_limit == 2 and seq.draft_misses == 0  # the whole draft held: the next may be twice as long
    assert seq.token_ids[-3:] == [6, 7, 8]


def test_drafts_stay_within_max_tokens_the_budget_and_the_free_blocks():
    sched = _scheduler()
    add(sched, [5, 6, 7, 8, 5, 6], params=SamplingParams(max_tokens=3))
    step(sched, token=7)
    out, outputs = _verify(sched, [8, 5])
    assert out.samples[0].drafts == (8,)  # one output so far: room for a draft and the model's token
    assert [o.token_id for o in outputs] == [8, 5] and outputs[-1].finish_reason == "length"

    sched = _scheduler(budget=3)
    add(sched, [5, 6, 7, 8, 5, 6])
    step(sched)  # half the prompt
    step(sched, token=7)
    assert sched.schedule().samples[0].drafts == (8, 5)  # the budget's 3 tokens: its own and two drafts

    sched = _scheduler(disable_by_batch_size=2)
    add(sched, [5, 6, 7, 8, 5, 6])
    add(sched, [5, 6, 7, 8, 5, 6])
    step(sched, token=7)
    assert [t.drafts for t in sched.schedule().samples] == [(), ()]  # two running: a batch too large to draft

    sched = _scheduler(num_blocks=2)  # 8 slots: the prompt, its token and one draft
    seq = add(sched, [5, 6, 7, 8, 5, 6])
    step(sched, token=7)
    out = sched.schedule()
    assert out.samples[0].drafts == (8,) and not out.preempted and seq.num_computed_tokens == 8


def test_drafts_that_missed_keep_the_step_fast_but_for_a_probing_step_in_32():
    cycle = [5, 6, 7, 8]

    def following(token: int, count: int) -> list[int]:
        return [cycle[(cycle.index(token) + 1 + i) % 4] for i in range(count)]

    sched = _scheduler(fast_step_tokens=1)  # a step of one token: any draft goes past it
    seq = add(sched, [5, 6, 7, 8, 5, 6])
    step(sched, token=7)
    _, outputs = _verify(sched, [5, 0, 0, 0])  # never drafted before: it may try, and misses outright
    assert seq.draft_limit == 1
    drafted = []
    while sched.draft_rounds < 33:
        out = sched.schedule()
        drafts = out.samples[0].drafts
        drafted.append((sched.draft_rounds, len(drafts)))
        sched.update_from_output(out, ModelOutput(following(seq.token_ids[-1], 1 + len(drafts))))
    # Its pause, then no drafts while they would slow the step; the 32nd step that could draft probes, its
    # draft holds, and a sequence whose drafts hold drafts past the edge again, twice as many.
    assert [r for r, count in drafted if count] == [32, 33] and dict(drafted)[33] == 2
    assert sched.spec.num_drafts == 3 and sched.spec.num_accepted_tokens == 1 + 2

    sched = _scheduler(fast_step_tokens=3)  # room for two drafts besides its own token
    seq = add(sched, [5, 6, 7, 8, 5, 6])
    step(sched, token=7)
    _verify(sched, [5, 0, 0, 0])
    step(sched, token=6)  # its pause
    assert sched.schedule().samples[0].drafts == (7,)  # within the edge it drafts as ever (its limit is one)
    sched.block_manager.check_invariants(sched.live_sequences())


def test_where_a_larger_step_is_compute_bound_no_draft_goes_past_the_fast_step():
    for strict, expected in ((False, (8, 5, 6)), (True, (8, 5))):
        sched = _scheduler(fast_step_tokens=3, strict_fast_step=strict)
        add(sched, [5, 6, 7, 8, 5, 6])
        step(sched, token=7)
        # Never drafted before: past the edge it may try, unless every token past it costs in full.
        assert sched.schedule().samples[0].drafts == expected
    sched = _scheduler(fast_step_tokens=3, strict_fast_step=True)
    for _ in range(4):
        add(sched, [5, 6, 7, 8, 5, 6])
    step(sched, token=7)
    assert [t.drafts for t in sched.schedule().samples] == [(), (), (), ()]  # four rows already: none fits


# ---- the engine -------------------------------------------------------------------------------------------------
def _llm(model_dir: Path, speculative: dict | None, **kwargs) -> LLM:
    options = {"dtype": "float32", "num_kv_blocks": 128, "max_model_len": 512, **kwargs}
    return LLM(str(model_dir), speculative_config=speculative, **options)


@pytest.fixture(scope="module")
def plain(cycling_llama_dir) -> LLM:
    return _llm(cycling_llama_dir, None)


@pytest.fixture(scope="module")
def speculating(cycling_llama_dir) -> LLM:
    return _llm(cycling_llama_dir, NGRAM)


def _choices(outputs) -> list[list[list[int]]]:
    return [[choice.token_ids for choice in out.outputs] for out in outputs]


def _assert_pool_empty(llm: LLM) -> None:
    llm.engine.check_invariants()
    bm = llm.engine.core.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_greedy_output_is_token_exact_and_most_drafts_are_accepted(plain, speculating):
    before = speculating.engine.core.stats().spec_decode
    for max_tokens in (1, 2, 9, 80):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
        expected, got = plain.generate(PROMPTS, params), speculating.generate(PROMPTS, params)
        assert _choices(got) == _choices(expected)
        for want, have in zip(expected, got, strict=True):
            for a, b in zip(want.outputs[0].logprobs, have.outputs[0].logprobs, strict=True):
                assert a.keys() == b.keys()
                assert all(math.isclose(a[t].logprob, b[t].logprob, rel_tol=1e-5, abs_tol=1e-4) for t in a)
                assert [a[t].rank for t in a] == [b[t].rank for t in a]
    stats = speculating.engine.core.stats().spec_decode
    drafted = stats.num_draft_tokens - before.num_draft_tokens
    accepted = stats.num_accepted_tokens - before.num_accepted_tokens
    assert drafted > 200 and accepted > 0.9 * drafted
    earlier = before.accepted_per_position + [0] * (4 - len(before.accepted_per_position))
    assert stats.accepted_per_position[3] > earlier[3]  # whole drafts of 4 held
    assert speculating.engine.core.num_steps < plain.engine.core.num_steps
    _assert_pool_empty(speculating)


def test_seeded_sampling_with_penalties_stops_and_n_is_what_it_is_without_speculation(plain, speculating):
    cases = [
        SamplingParams(temperature=2.5, top_p=0.9, max_tokens=60, seed=11, ignore_eos=True),
        SamplingParams(temperature=1.5, max_tokens=50, seed=5, n=3, repetition_penalty=1.2, frequency_penalty=0.3,
                       ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[90, 740], min_tokens=9, logprobs=1),
        SamplingParams(temperature=0, max_tokens=40, bad_words=["fox"], allowed_token_ids=list(range(80, 800))),
    ]
    before = speculating.engine.core.stats().spec_decode
    for params in cases:
        expected, got = plain.generate(PROMPTS, params), speculating.generate(PROMPTS, params)
        assert _choices(got) == _choices(expected), params
        assert [[c.finish_reason for c in o.outputs] for o in got] == [[c.finish_reason for c in o.outputs] for o in expected]
    after = speculating.engine.core.stats().spec_decode
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    assert 0 < accepted < after.num_draft_tokens - before.num_draft_tokens  # drafts held and drafts missed
    _assert_pool_empty(speculating)


def test_preemption_keeps_the_tokens_and_leaks_no_block(cycling_llama_dir, plain):
    params = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)
    prompts = [f"{p} {i}" for i in range(3) for p in PROMPTS]
    expected = plain.generate(prompts, params)
    tight = _llm(cycling_llama_dir, NGRAM, num_kv_blocks=40, max_model_len=128)  # 640 slots for 12 sequences of ~80
    got = tight.generate(prompts, params)
    assert _choices(got) == _choices(expected)
    assert tight.engine.core.scheduler.num_preemptions > 0
    _assert_pool_empty(tight)


def test_a_conversation_going_on_reads_the_blocks_filled_while_speculating(plain, speculating):
    params = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)
    first = speculating.generate(PROMPTS[:2], params)
    turns = [{"prompt_token_ids": out.prompt_token_ids + out.outputs[0].token_ids[:60]} for out in first]
    again = speculating.generate(turns, params)
    assert _choices(again) == _choices(plain.generate(turns, params))
    # Every prompt token but the last is reused: the full blocks, and the partly filled tail after them.
    assert [out.num_cached_tokens for out in again] == [len(t["prompt_token_ids"]) - 1 for t in turns]
    _assert_pool_empty(speculating)


def test_structured_output_runs_without_drafts(speculating):
    from llmserve.sampling.params import StructuredOutputsParams

    before = speculating.engine.core.stats().spec_decode.num_drafts
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    (out,) = speculating.generate(["Answer:"], params)
    assert out.outputs[0].text in ("yes", "no")
    assert speculating.engine.core.stats().spec_decode.num_drafts == before


def test_bf16_batch_one_through_the_one_call_decoder_gives_the_same_bits(cycling_llama_dir):
    """A draft's row is a short chunk to the CPU decoder: each of its tokens computed as its decode would be."""
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=2)
    plain, speculating = (_llm(cycling_llama_dir, spec, dtype="bfloat16") for spec in (None, NGRAM))
    expected, got = plain.generate(PROMPTS[:1], params), speculating.generate(PROMPTS[:1], params)
    assert _choices(got) == _choices(expected)
    assert got[0].outputs[0].logprobs == expected[0].outputs[0].logprobs
    assert speculating.engine.core.stats().spec_decode.num_accepted_tokens > 40
    scheduler = speculating.engine.core.scheduler
    assert scheduler.fast_step_tokens == cpu_linear.max_rows()  # where steps get dearer
    assert scheduler.strict_fast_step is not cpu_linear.native_bf16_gemm()  # and whether past it is compute-bound


def test_a_lora_adapters_drafts_are_verified_through_the_adapter(cycling_llama_dir, tmp_path):
    """A draft's row carries its sequence's adapter: the tokens are the adapter's own, one at a time or not."""
    from llmserve import LoRARequest
    from tests.hf_reference import build_lora_adapter

    adapter = LoRARequest("a", 1, str(build_lora_adapter(cycling_llama_dir, tmp_path / "a", rank=4, seed=2)))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain, speculating = (_llm(cycling_llama_dir, spec, enable_lora=True, max_lora_rank=4) for spec in (None, NGRAM))
    expected = plain.generate(PROMPTS, params, lora_request=adapter)
    got = speculating.generate(PROMPTS, params, lora_request=adapter)
    assert _choices(got) == _choices(expected)
    assert _choices(got) != _choices(plain.generate(PROMPTS, params))  # the adapter changes the tokens
    assert speculating.engine.core.stats().spec_decode.num_accepted_tokens > 0
    _assert_pool_empty(speculating)
