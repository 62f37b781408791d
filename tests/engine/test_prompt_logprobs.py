"""Prompt logprobs (SamplingParams.prompt_logprobs) and sampled-token `Logprob`s equal transformers'
float32 log_softmax on the same weights: values, ranks among the raw logits and the top-k, under
chunked prefill, preemption, prefix caching and overlapped scheduling; vLLM's prompt dicts and
truncate_prompt_tokens offline."""

from __future__ import annotations

import random

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.errors import InvalidRequestError
from tests import hf_reference

TOP = 3
ATOL = 2e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_llama_dir):
    out = tmp_path_factory.mktemp("plp-llama")
    hf_reference.build_checkpoint("llama", out, tiny_llama_dir)
    return out, hf_reference.load_model(out)


@torch.no_grad()
def reference_scores(model, token_ids: list[int], top: int) -> list[tuple[float, int, list[int], list[float]]]:
    """For each token after the first: (logprob, rank among the raw logits, top ids, top logprobs)."""
    logits = model(torch.tensor([token_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    scores = []
    for i in range(1, len(token_ids)):
        token = token_ids[i]
        rank = int((logits[i - 1] > logits[i - 1, token]).sum()) + 1
        values, ids = torch.topk(logprobs[i - 1], top)
        scores.append((float(logprobs[i - 1, token]), rank, ids.tolist(), values.tolist()))
    return scores


def _check_entry(entry, token: int, expected, top: int) -> None:
    logprob, rank, top_ids, top_logprobs = expected
    assert entry[token].logprob == pytest.approx(logprob, abs=ATOL)
    assert entry[token].rank == rank
    for position, (top_id, top_logprob) in enumerate(zip(top_ids[:top], top_logprobs[:top], strict=True)):
        assert top_id in entry
        assert entry[top_id].logprob == pytest.approx(top_logprob, abs=ATOL)
        if top_id != token:
            assert entry[top_id].rank == position + 1
    assert set(entry) == {token, *top_ids[:top]}


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 1024) for _ in range(rng.randint(2, 90))] for _ in range(count)]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlap", "serial"])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cache", "nocache"])
def test_prompt_logprobs_match_transformers_under_chunking_and_preemption(checkpoint, prefix_caching,
                                                                        async_scheduling):
    model_dir, reference = checkpoint
    llm = LLM(
        str(model_dir), dtype="float32", num_kv_blocks=24, max_num_batched_tokens=32, max_model_len=256,
        enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling,
    )
    prompts = _prompts(12, seed=5)
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # The first half runs once before: with prefix caching on, their prompts are cached, and
    # requests asking for prompt logprobs must compute them anyway.
    llm.generate(prompts[:6], plain)
    scored = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=TOP, logprobs=2)
    outs = llm.generate(prompts, scored)
    assert sum(out.metrics.num_preemptions for out in outs) > 0  # requests scoring their prompts were preempted
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.num_cached_tokens == 0
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None
        for token, entry, expected in zip(
            prompt[1:], out.prompt_logprobs[1:], reference_scores(reference, prompt, TOP), strict=True
        ):
            _check_entry(entry, token, expected, TOP)
        completion = out.outputs[0]
        assert completion.token_ids == hf_reference.greedy(reference, prompt, 16)
        full = prompt + completion.token_ids
        expected_outputs = reference_scores(reference, full, 2)[len(prompt) - 1:]
        assert completion.logprobs is not None
        for token, entry, expected in zip(completion.token_ids, completion.logprobs, expected_outputs, strict=True):
            _check_entry(entry, token, expected, 2)
    # They filled the cache even though they did not read it.
    if prefix_caching:
        again = llm.generate(prompts[6:], plain)
        assert any(o.num_cached_tokens > 0 for o in again)
    llm.engine.check_invariants()
    assert llm.engine.core.block_manager.num_free_blocks == 24


def test_logprob_objects_rank_sampled_tokens_and_decode_them(checkpoint):
    model_dir, reference = checkpoint
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256)
    tokenizer = llm.get_tokenizer()
    prompt = _prompts(1, seed=6)[0]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=4, prompt_logprobs=0)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    completion = out.outputs[0]
    expected = reference_scores(reference, prompt + completion.token_ids, 4)[len(prompt) - 1:]
    assert any(entry[t].rank > 1 for t, entry in zip(completion.token_ids, completion.logprobs, strict=True))
    for token, entry, exp in zip(completion.token_ids, completion.logprobs, expected, strict=True):
        _check_entry(entry, token, exp, 4)
        for token_id, logprob in entry.items():
            assert logprob.decoded_token == tokenizer.decode([token_id], skip_special_tokens=False)
    # prompt_logprobs=0: the prompt token's own logprob only
    assert all(len(entry) == 1 for entry in out.prompt_logprobs[1:])
    assert completion.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in
                                                              zip(completion.token_ids, completion.logprobs, strict=True)))


def test_prompt_logprobs_come_once_for_n_choices_and_for_a_one_token_prompt(checkpoint):
    model_dir, reference = checkpoint
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=16)
    prompt = _prompts(1, seed=7)[0][:40] + [5] * 10
    outs = llm.generate([prompt, [9]], SamplingParams(n=3, max_tokens=4, seed=1, prompt_logprobs=1))
    assert len(outs[0].outputs) == 3
    for token, entry, expected in zip(prompt[1:], outs[0].prompt_logprobs[1:],
                                      reference_scores(reference, prompt, 1), strict=True):
        _check_entry(entry, token, expected, 1)
    assert outs[1].prompt_logprobs == [None]
    llm.engine.check_invariants()


def test_prompt_dicts_and_mixed_lists(checkpoint):
    model_dir, _ = checkpoint
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256)
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ids = tokenizer.encode("hello world")
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt": "hello world"}, "hello world", ids], params)
    assert outs[0].prompt_token_ids == [1, 2, 3]
    assert outs[1].prompt_token_ids == outs[2].prompt_token_ids == ids
    assert outs[1].prompt == "hello world"
    assert outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids == outs[3].outputs[0].token_ids
    single = llm.generate({"prompt_token_ids": [1, 2, 3]}, params)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="multi_modal_data"):
        llm.generate({"prompt": "x", "multi_modal_data": {}}, params)
    with pytest.raises(InvalidRequestError, match="exactly one"):
        llm.generate({"prompt": "x", "prompt_token_ids": [1]}, params)
    assert not llm.engine.has_unfinished_requests()


def test_truncate_prompt_tokens_keeps_the_last_tokens(checkpoint):
    model_dir, _ = checkpoint
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=64)
    prompt = list(range(10, 110))  # longer than the context window
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                truncate_prompt_tokens=20))[0]
    assert out.prompt_token_ids == prompt[-20:]
    assert out.outputs[0].token_ids == llm.generate([prompt[-20:]], params)[0].outputs[0].token_ids
    assert llm.generate([prompt[:5]], SamplingParams(max_tokens=2, truncate_prompt_tokens=20))[0].prompt_token_ids \
        == prompt[:5]
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        llm.generate([prompt], params)
    for bad in (0, -2):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(truncate_prompt_tokens=bad)
        assert info.value.param == "truncate_prompt_tokens"
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(prompt_logprobs=21)
    assert info.value.param == "prompt_logprobs"
