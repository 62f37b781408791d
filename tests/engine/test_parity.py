"""Greedy outputs token-identical to transformers, one prompt and many, under chunked prefill,
preemption and prefix-cache hits, for every supported architecture (float32, random weights), with
overlapped scheduling (the default: step N+1 is scheduled and launched before step N's tokens reach
the host) and without it."""

from __future__ import annotations

import functools
import random

import pytest

from llmserve import LLM, SamplingParams
from tests import hf_reference

MAX_NEW = 24


@pytest.fixture(scope="module", params=sorted(hf_reference.ARCH_CASES))
def checkpoint(request, tmp_path_factory, tiny_llama_dir):
    case = request.param
    out = tmp_path_factory.mktemp(case)
    hf_reference.build_checkpoint(case, out, tiny_llama_dir, shard=case == "qwen2")
    return out, hf_reference.load_model(out)


@functools.cache
def _reference_tokens(reference, prompt: tuple[int, ...]) -> list[int]:
    """transformers' greedy tokens for `prompt`, computed once per model (the four batch variants share prompts)."""
    return hf_reference.greedy(reference, list(prompt), MAX_NEW)


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 1024) for _ in range(rng.randint(3, 90))] for _ in range(count)]


def test_single_prompt_matches_transformers(checkpoint):
    model_dir, reference = checkpoint
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64)
    prompt = _prompts(1, seed=1)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == hf_reference.greedy(reference, prompt, MAX_NEW)
    assert out.outputs[0].finish_reason == "length"
    llm.engine.check_invariants()
    assert llm.engine.core.block_manager.num_free_blocks == 64


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cache", "nocache"])
def test_mixed_batch_with_chunked_prefill_and_preemption_matches_transformers(checkpoint, prefix_caching,
                                                                             async_scheduling):
    model_dir, reference = checkpoint
    # 18 prompts of 3-90 tokens, a 32-token step budget (long prompts take several chunks) and a pool
    # of 24 blocks (384 tokens) that cannot hold them all at once: preemption must happen (and with
    # prefix caching, preempted sequences come back through the cache).
    llm = LLM(
        str(model_dir), dtype="float32", num_kv_blocks=24, max_num_batched_tokens=32, max_model_len=256,
        enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling,
    )
    prompts = _prompts(18, seed=2)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))
    assert llm.engine.stats().num_preemptions > 0
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == _reference_tokens(reference, tuple(prompt))
    llm.engine.check_invariants()
    assert llm.engine.core.block_manager.num_free_blocks == 24


def test_shared_prefixes_and_a_follow_up_turn_reuse_the_cache_and_match_transformers(checkpoint):
    model_dir, reference = checkpoint
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32, max_model_len=256)
    system = _prompts(1, seed=3)[0][:3] + list(range(100, 140))  # 43 shared tokens
    prompts = [system + suffix for suffix in _prompts(4, seed=4)]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate(prompts[:1], params)[0]
    outs = [first] + llm.generate(prompts[1:], params)
    follow_up = prompts[0] + first.outputs[0].token_ids + [7, 8, 9]
    outs += llm.generate([follow_up], params)
    assert [o.num_cached_tokens for o in outs[1:4]] == [32] * 3
    # Every token turn 1 computed is reused: its full blocks and, to the token, its partly filled tail.
    assert outs[4].num_cached_tokens == len(prompts[0]) + MAX_NEW - 1
    for prompt, out in zip(prompts + [follow_up], outs, strict=True):
        assert out.outputs[0].token_ids == hf_reference.greedy(reference, prompt, MAX_NEW)
    llm.engine.check_invariants()
    assert llm.engine.core.block_manager.num_free_blocks == 64
