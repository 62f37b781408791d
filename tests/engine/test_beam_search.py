"""Beam search (`use_beam_search`) offline: the n best beams token for token as transformers' beam search finds
them when no beam can end (float32, random weights), beams that end at an end token as a plain reference search
over transformers' logprobs ranks them (vLLM's scoring, with length_penalty), sampled prompts run alongside, and
what beam search does not take refused naming the field."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.errors import InvalidRequestError
from tests import hf_reference

PROMPTS = [[5, 17, 99, 300, 41, 8, 77], [600, 3, 250, 12]]
WIDTH = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_llama_dir) -> tuple[Path, object]:
    model_dir = hf_reference.build_checkpoint("llama", tmp_path_factory.mktemp("llama"), tiny_llama_dir)
    return model_dir, hf_reference.load_model(model_dir)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(str(checkpoint[0]), dtype="float32", num_kv_blocks=64)


def _beams(width: int, max_tokens: int, **options) -> SamplingParams:
    return SamplingParams(n=width, temperature=0, max_tokens=max_tokens, use_beam_search=True, **options)


def test_beams_are_transformers_beams_when_none_can_end_and_sampled_prompts_run_alongside(checkpoint, llm):
    _, reference = checkpoint
    reference.generation_config.eos_token_id = None  # no beam ends: both keep the best `WIDTH` at every step
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(PROMPTS + [PROMPTS[0]], [_beams(WIDTH, 12, ignore_eos=True)] * 2 + [greedy])
    for prompt, out in zip(PROMPTS, outs, strict=False):
        with torch.no_grad():
            theirs = reference.generate(torch.tensor([prompt]), num_beams=WIDTH, num_return_sequences=WIDTH,
                                        do_sample=False, max_new_tokens=12, pad_token_id=0,
                                        output_scores=True, return_dict_in_generate=True)
        assert [o.token_ids for o in out.outputs] == [s[len(prompt):].tolist() for s in theirs.sequences]
        assert [o.finish_reason for o in out.outputs] == ["length"] * WIDTH
        ours = torch.tensor([o.cumulative_logprob / 12 for o in out.outputs])  # theirs: over the output's length
        torch.testing.assert_close(ours, theirs.sequences_scores, rtol=1e-4, atol=1e-4)
    assert outs[2].outputs[0].token_ids == hf_reference.greedy(reference, PROMPTS[0], 12)
    llm.engine.check_invariants()
    assert llm.engine.core.block_manager.num_free_blocks == 64


def _reference_search(model, prompt: list[int], width: int, max_tokens: int, enders: set[int],
                      length_penalty: float) -> list[tuple[list[int], bool]]:
    """vLLM's beam search over transformers' logprobs, written plainly: (tokens, ended) of the best `width`."""
    def score(beam: tuple[list[int], float, bool]) -> float:
        tokens, total, ended = beam
        return total / ((len(prompt) + len(tokens) - ended) ** length_penalty)

    live, finished = [([], 0.0, False)], []
    for _ in range(max_tokens):
        if len(finished) >= width and max(map(score, live)) < sorted(map(score, finished), reverse=True)[width - 1]:
            break
        candidates = []
        for tokens, total, _ in live:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits[0, -1]
            top = torch.log_softmax(logits.float(), -1).topk(2 * width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                grown = (tokens + [token], total + logprob, token in enders)
                (finished if token in enders else candidates).append(grown)
        live = sorted(candidates, key=score, reverse=True)[:width]
        if not live:
            break
    best = sorted(finished + live, key=score, reverse=True)[:width]
    return [(tokens, ended) for tokens, _, ended in best]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0])
def test_beams_end_at_stop_tokens_and_rank_as_the_reference_search(checkpoint, llm, length_penalty):
    _, reference = checkpoint
    prompt = PROMPTS[0]
    # end tokens the beams meet early: the second and fourth tokens of the greedy continuation
    greedy = hf_reference.greedy(reference, prompt, 4)
    enders = {greedy[1], greedy[3]}
    params = _beams(3, 10, ignore_eos=True, stop_token_ids=sorted(enders), length_penalty=length_penalty, logprobs=2)
    out = llm.generate([prompt], params)[0]
    expected = _reference_search(reference, prompt, 3, 10, enders, length_penalty)
    assert [(o.token_ids, o.finish_reason == "stop") for o in out.outputs] == expected
    assert any(ended for _, ended in expected)
    for choice in out.outputs:
        assert len(choice.logprobs) == len(choice.token_ids)
        assert math.isclose(sum(entry[token].logprob for entry, token in zip(choice.logprobs, choice.token_ids,
                                                                             strict=True)),
                            choice.cumulative_logprob, rel_tol=1e-9)
        assert all(len(entry) <= 3 for entry in choice.logprobs)  # the token's own and the top 2
        if choice.finish_reason == "stop":
            assert choice.stop_reason == choice.token_ids[-1] in enders
    llm.engine.check_invariants()


@pytest.mark.parametrize("options, param", [
    ({"temperature": 0.7}, "temperature"),
    ({"top_p": 0.9}, "top_p"),
    ({"stop": ["x"]}, "stop"),
    ({"logit_bias": {5: 1.0}}, "logit_bias"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"min_tokens": 2}, "min_tokens"),
    ({"n": 11}, "n"),
    ({"length_penalty": math.inf}, "length_penalty"),
])
def test_what_beam_search_does_not_take_is_refused_naming_it(options, param):
    with pytest.raises(InvalidRequestError) as raised:
        SamplingParams(**{"n": 2, "temperature": 0, "use_beam_search": True, **options})
    assert raised.value.param == param


def test_the_engine_core_runs_no_beam_search(llm):
    with pytest.raises(InvalidRequestError, match="runs no beam search"):
        llm.engine.add_request("direct", [5, 6, 7], _beams(2, 4))
