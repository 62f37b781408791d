"""Speculative decoding with a draft model (vLLM's `draft_model` method): a second, smaller model decodes a few
tokens ahead and the served model verifies them, so what comes out is token for token what the served model
gives alone, whatever the draft proposes, and neither model's KV pool leaks a block.

The served model is the crafted tiny Llama that repeats cycles of 7 tokens (tests/cycling_model.py). Drafted by
itself every draft holds; drafted by the random tiny Llama (the same vocabulary, other weights) most miss, which
tests the rejections, the draft's cache going back and its catching up."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from llmserve import LLM, SamplingParams
from llmserve.config import EngineConfig, SpeculativeConfig, parse_speculative_config
from llmserve.errors import ModelLoadError
from llmserve.model.builtin import make_model

PROMPTS = ["The quick brown fox", "Once upon a time", "def fibonacci(n):", "In a distant galaxy, far away"]


def _draft(model_dir: Path, k: int = 4) -> dict:
    return {"model": str(model_dir), "num_speculative_tokens": k}


def _llm(model_dir: Path, speculative: dict | None, **kwargs) -> LLM:
    options = {"dtype": "float32", "num_kv_blocks": 128, "max_model_len": 512, **kwargs}
    return LLM(str(model_dir), speculative_config=speculative, **options)


@pytest.fixture(scope="module")
def other_llama_dir(tmp_path_factory) -> Path:
    """A tiny Llama of the same vocabulary with other random weights: a draft that mostly misses."""
    return make_model(tmp_path_factory.mktemp("other-llama"), "llama", "tiny", 1)


@pytest.fixture(scope="module")
def plain(cycling_llama_dir) -> LLM:
    return _llm(cycling_llama_dir, None)


@pytest.fixture(scope="module")
def self_drafted(cycling_llama_dir) -> LLM:
    return _llm(cycling_llama_dir, _draft(cycling_llama_dir))


@pytest.fixture(scope="module")
def badly_drafted(cycling_llama_dir, other_llama_dir) -> LLM:
    return _llm(cycling_llama_dir, _draft(other_llama_dir, k=3))


def _choices(outputs) -> list[list[list[int]]]:
    return [[choice.token_ids for choice in out.outputs] for out in outputs]


def _assert_nothing_held(llm: LLM) -> None:
    llm.engine.check_invariants()
    core = llm.engine.core
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    proposer = core.scheduler.proposer
    assert not proposer.states and len(proposer.free_blocks) == proposer.runner.num_blocks


def _spec_counts(llm: LLM) -> tuple[int, int]:
    stats = llm.engine.core.stats().spec_decode
    return stats.num_draft_tokens, stats.num_accepted_tokens


# ---- the config ---------------------------------------------------------------------------------------------
def test_a_model_in_the_speculative_config_is_a_draft_model_and_what_it_cannot_take_is_named():
    assert parse_speculative_config({"model": "m", "num_speculative_tokens": 3}) == SpeculativeConfig(
        3, method="draft_model", model="m")
    assert parse_speculative_config({"method": "draft_model", "model": "m", "num_speculative_tokens": 2,
                                     "disable_by_batch_size": 4, "draft_tensor_parallel_size": 1}) == SpeculativeConfig(
        2, method="draft_model", model="m", disable_by_batch_size=4)
    for bad, named in (
        ({"method": "draft_model", "num_speculative_tokens": 3}, "needs \"model\""),
        ({"model": "m", "num_speculative_tokens": 3, "prompt_lookup_max": 2}, "prompt_lookup_max belong to the ngram"),
        ({"method": "ngram", "model": "m", "num_speculative_tokens": 3}, "takes no model"),
        ({"method": "eagle", "model": "m", "num_speculative_tokens": 3}, "'eagle' is not supported"),
        ({"model": "m"}, "num_speculative_tokens must be a positive integer"),
        ({"model": "m", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}, "must be 1: the draft model runs"),
    ):
        with pytest.raises(ValueError, match=named):
            EngineConfig(model="x", speculative_config=bad).validate()


def test_a_draft_the_served_model_cannot_verify_fails_at_start(cycling_llama_dir, tmp_path):
    larger = tmp_path / "larger-vocabulary"
    shutil.copytree(cycling_llama_dir, larger)
    config = json.loads((larger / "config.json").read_text())
    (larger / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 1}))
    with pytest.raises(ModelLoadError, match="vocabulary .* is larger than the served model's"):
        _llm(cycling_llama_dir, _draft(larger))
    with pytest.raises(ModelLoadError):
        _llm(cycling_llama_dir, _draft(tmp_path / "nowhere"))


# ---- the engine ---------------------------------------------------------------------------------------------
def test_drafted_by_itself_every_draft_holds_and_the_output_is_token_exact(plain, self_drafted):
    before = _spec_counts(self_drafted)
    for max_tokens in (1, 2, 9, 60):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
        assert _choices(self_drafted.generate(PROMPTS, params)) == _choices(plain.generate(PROMPTS, params))
    drafted, accepted = (after - was for after, was in zip(_spec_counts(self_drafted), before, strict=True))
    assert drafted > 150 and accepted == drafted
    assert self_drafted.engine.core.num_steps < plain.engine.core.num_steps
    _assert_nothing_held(self_drafted)


def test_a_draft_that_misses_changes_no_token_greedy_or_seeded(plain, badly_drafted):
    cases = [
        SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
        SamplingParams(temperature=1.5, max_tokens=40, seed=5, n=2, repetition_penalty=1.2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[90, 740], min_tokens=5),
    ]
    before = _spec_counts(badly_drafted)
    for params in cases:
        expected, got = plain.generate(PROMPTS, params), badly_drafted.generate(PROMPTS, params)
        assert _choices(got) == _choices(expected), params
        assert [[c.finish_reason for c in o.outputs] for o in got] == [[c.finish_reason for c in o.outputs] for o in expected]
    drafted, accepted = (after - was for after, was in zip(_spec_counts(badly_drafted), before, strict=True))
    assert drafted > 0 and accepted < drafted
    _assert_nothing_held(badly_drafted)


def test_prompts_longer_than_a_step_are_caught_up_in_chunks(cycling_llama_dir, plain):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [" ".join(PROMPTS) * 6, PROMPTS[0]]  # ~150 tokens, past the 32-token step
    llm = _llm(cycling_llama_dir, _draft(cycling_llama_dir), max_num_batched_tokens=32)
    assert _choices(llm.generate(prompts, params)) == _choices(plain.generate(prompts, params))
    drafted, accepted = _spec_counts(llm)
    assert drafted > 0 and accepted == drafted
    _assert_nothing_held(llm)


def test_preemption_and_a_full_draft_pool_keep_the_tokens_and_leak_no_block(cycling_llama_dir, other_llama_dir, plain):
    params = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)
    prompts = [f"{p} {i}" for i in range(3) for p in PROMPTS]
    expected = plain.generate(prompts, params)
    tight = _llm(cycling_llama_dir, _draft(other_llama_dir, k=3), num_kv_blocks=40, max_model_len=128)
    assert _choices(tight.generate(prompts, params)) == _choices(expected)
    assert tight.engine.core.scheduler.num_preemptions > 0
    _assert_nothing_held(tight)


def test_aborted_requests_give_the_draft_its_blocks_back(self_drafted):
    engine = self_drafted.engine
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"abort-{i}", prompt, params)
    for _ in range(6):
        engine.step()
    proposer = engine.core.scheduler.proposer
    assert proposer.states and len(proposer.free_blocks) < proposer.runner.num_blocks
    engine.check_invariants()
    engine.abort_request([f"abort-{i}" for i in range(len(PROMPTS))])
    _assert_nothing_held(self_drafted)


def test_the_two_kv_pools_share_the_kv_memory_block_for_block(cycling_llama_dir, other_llama_dir):
    memory = 1 << 20
    llm = LLM(str(cycling_llama_dir), dtype="float32", max_model_len=256, kv_cache_memory=memory,
              speculative_config=_draft(other_llama_dir))
    core = llm.engine.core
    draft_runner = core.scheduler.proposer.runner
    per_block = core.runner.kv_bytes_per_block() + draft_runner.kv_bytes_per_block()
    assert core.runner.num_blocks == draft_runner.num_blocks == memory // per_block
    assert core.runner.kv_cache_bytes + draft_runner.kv_cache_bytes <= memory
