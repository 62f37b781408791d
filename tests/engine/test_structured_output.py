"""Structured output in the engine, offline through `LLM` on the tiny built-in model: every output of
200 generated JSON schemas validates, regex / choice / EBNF outputs match, constrained greedy
requests give the same tokens alone, under preemption, on prefix-cache hits and with overlapped
scheduling on or off; n > 1 and seeds reproduce; bad specs are InvalidRequestError naming
structured_outputs; a grammar that compiles slowly does not hold up other requests, and one that
fails in the core ends only its request. No leaked KV blocks anywhere."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import jsonschema
import numpy as np
import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.bench.json_schemas import generate_schemas
from llmserve.config import EngineConfig
from llmserve.engine.async_llm import AsyncLLM
from llmserve.errors import InvalidRequestError
from llmserve.sampling.params import StructuredOutputsParams
from llmserve.sampling.sampler import Sampler, SamplingMetadata, SamplingRow

PROMPTS = ["The quick brown fox", "Once upon a time", "def fibonacci(n):", "Un café au lait. 日本語", "Hello"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-c]{3}-[0-9]{2}(\.[xyz])?"
GRAMMAR = r"""root ::= pair ("," pair){0,2}
pair ::= key "=" num
key ::= [a-z] [a-z]?
num ::= [0-9] | [1-9] [0-9]"""
GRAMMAR_RE = r"[a-z]{1,2}=(?:[0-9]|[1-9][0-9])(?:,[a-z]{1,2}=(?:[0-9]|[1-9][0-9])){0,2}"


def _so(**kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


def _json(**kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 200)
    return SamplingParams(structured_outputs=_so(json=json.dumps(SCHEMA)), **kwargs)


def _assert_pool_empty(llm: LLM) -> None:
    engine = llm.engine
    engine.check_invariants()
    bm = engine.core.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == stats.num_unfinished_requests == 0


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=512, max_model_len=1024)


def test_every_output_of_200_generated_schemas_validates(llm):
    schemas = generate_schemas(200, seed=0)
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=400, structured_outputs=_so(json=schema))
        for i, schema in enumerate(schemas)
    ]
    outputs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(schemas))], params)
    for schema, out in zip(schemas, outputs, strict=True):
        choice = out.outputs[0]
        assert choice.finish_reason == "stop", (schema, choice.text)
        jsonschema.validate(json.loads(choice.text), schema)
    _assert_pool_empty(llm)


def test_json_object_regex_choice_and_grammar_outputs_match(llm):
    choices = ["alpha beta", "gamma", 'q"uote', "日本"]
    cases = [
        (SamplingParams(n=4, seed=1, max_tokens=40, structured_outputs=_so(regex=REGEX)),
         lambda text: re.fullmatch(REGEX, text)),
        (SamplingParams(n=4, seed=2, max_tokens=40, structured_outputs=_so(choice=choices)),
         lambda text: text in choices),
        (SamplingParams(n=4, seed=3, max_tokens=60, structured_outputs=_so(grammar=GRAMMAR)),
         lambda text: re.fullmatch(GRAMMAR_RE, text)),
        (SamplingParams(n=2, seed=4, max_tokens=300, structured_outputs=_so(json_object=True)),
         lambda text: isinstance(json.loads(text), dict)),
    ]
    outputs = llm.generate(["Pick one:"] * len(cases), [params for params, _ in cases])
    for (params, matches), out in zip(cases, outputs, strict=True):
        assert len(out.outputs) == params.n
        for choice in out.outputs:
            if params.structured_outputs.json_object and choice.finish_reason == "length":
                continue  # free-form strings may run past max_tokens; the finish says so
            assert choice.finish_reason == "stop" and matches(choice.text), choice.text
    _assert_pool_empty(llm)


def test_a_json_dict_is_accepted_offline(llm):
    out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=200, structured_outputs=_so(json=SCHEMA)))[0]
    jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_greedy_output_is_the_same_under_preemption_and_prefix_cache_hits(tiny_llama_dir, llm):
    params = [_json(temperature=0, max_tokens=100), SamplingParams(temperature=0, max_tokens=40, structured_outputs=_so(
        regex=REGEX))]
    alone = {(i, j): llm.generate(p, params[j])[0].outputs[0].token_ids for i, p in enumerate(PROMPTS)
             for j in range(2)}
    # A pool too small for the batch (preemptions) and a small token budget (chunked prefill).
    small = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=8, max_num_batched_tokens=16,
                max_model_len=128)
    keys = list(alone)
    batch = small.generate([PROMPTS[i] for i, _ in keys], [params[j] for _, j in keys])
    assert small.engine.stats().num_preemptions > 0
    assert [out.outputs[0].token_ids for out in batch] == [alone[k] for k in keys]
    _assert_pool_empty(small)
    # The same prompts again: their prefix blocks are cached now.
    again = llm.generate([PROMPTS[i] for i, _ in keys], [params[j] for _, j in keys])
    assert sum(out.num_cached_tokens for out in again) > 0
    assert [out.outputs[0].token_ids for out in again] == [alone[k] for k in keys]
    _assert_pool_empty(llm)


def test_overlapped_and_serial_scheduling_agree(tiny_llama_dir, llm):
    serial = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, max_model_len=1024,
                 async_scheduling=False)
    params = [_json(temperature=0.8, seed=7, n=3), SamplingParams(seed=8, max_tokens=40, structured_outputs=_so(
        regex=REGEX)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    a = llm.generate(PROMPTS[:3], params)
    b = serial.generate(PROMPTS[:3], params)
    assert [[c.token_ids for c in o.outputs] for o in a] == [[c.token_ids for c in o.outputs] for o in b]
    _assert_pool_empty(serial)


def test_n_choices_follow_their_own_grammar_and_seeds_reproduce(llm):
    params = _json(temperature=1.0, seed=11, n=4)
    first = llm.generate("Describe someone", params)[0]
    second = llm.generate("Describe someone", params)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # the choices draw differently
    for choice in first.outputs:
        jsonschema.validate(json.loads(choice.text), SCHEMA)
    _assert_pool_empty(llm)


def test_max_tokens_returns_what_was_generated_and_stop_strings_end_the_choice(llm):
    short = llm.generate("Hi", _json(temperature=0, max_tokens=4))[0].outputs[0]
    full = llm.generate("Hi", _json(temperature=0))[0].outputs[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 4
    assert short.token_ids == full.token_ids[:4] and full.text.startswith(short.text)
    stopped = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=40, stop=["-"],
                                                structured_outputs=_so(regex=REGEX)))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "-" and re.fullmatch("[a-c]{3}", stopped.text)
    _assert_pool_empty(llm)


def test_min_tokens_gives_way_when_the_grammar_allows_only_an_end(llm):
    out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=20, min_tokens=10,
                                            structured_outputs=_so(choice=["gamma"])))[0].outputs[0]
    assert out.text == "gamma" and out.finish_reason == "stop"


def test_start_after_leaves_the_output_free_until_the_trigger(llm):
    free = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0].outputs[0]
    trigger = free.token_ids
    out = llm.generate("Hi", SamplingParams(temperature=0, max_tokens=40, structured_outputs=_so(
        regex=REGEX, start_after=trigger)))[0].outputs[0]
    assert out.token_ids[:1] == trigger
    assert re.fullmatch(REGEX, llm.get_tokenizer().decode(out.token_ids[1:]))


@pytest.mark.parametrize(
    ("so", "message"),
    [
        (_so(json='{"type": "object", "properties": {"a": {"type": "nonsense"}}}'), "JSON schema"),
        (_so(json="{not json"), "JSON schema"),
        (_so(regex="(unclosed"), "regex"),
        (_so(grammar="root ::= missing_rule"), "grammar"),
        (_so(choice=[]), "choice"),
        (_so(regex="a", choice=["a"]), "exactly one"),
        (_so(), "exactly one"),
    ],
)
def test_bad_specs_are_invalid_requests_naming_structured_outputs(llm, so, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        llm.generate("Hi", SamplingParams(structured_outputs=so))
    assert info.value.param == "structured_outputs"
    _assert_pool_empty(llm)


def _slow_compiles(core, release: threading.Event, fail: bool = False):
    manager = core.structured_output
    compile_now = manager._compile

    def held(spec):
        release.wait()
        if fail:
            raise RuntimeError("compile failed")
        return compile_now(spec)

    manager._compile = held
    return lambda: setattr(manager, "_compile", compile_now)


def test_a_slow_grammar_does_not_stall_other_requests(llm):
    engine = llm.engine
    release = threading.Event()
    restore = _slow_compiles(engine.core, release)
    try:
        engine.add_request("slow", "Hi", SamplingParams(max_tokens=40, structured_outputs=_so(regex="[a-z]{2}[0-9]")))
        engine.add_request("plain", "Hi", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        finished = {}
        while "plain" not in finished:
            finished.update({out.request_id: out for out in engine.step() if out.finished})
        assert "slow" not in finished and engine.stats().num_waiting == 1
        assert len(finished["plain"].outputs[0].token_ids) == 30
        release.set()
        while engine.has_unfinished_requests():
            finished.update({out.request_id: out for out in engine.step() if out.finished})
    finally:
        release.set()
        restore()
    assert re.fullmatch("[a-z]{2}[0-9]", finished["slow"].outputs[0].text)
    _assert_pool_empty(llm)


def test_a_grammar_failing_in_the_core_ends_only_its_request(llm):
    engine = llm.engine
    release = threading.Event()
    release.set()
    restore = _slow_compiles(engine.core, release, fail=True)
    try:
        engine.add_request("bad", "Hi", SamplingParams(n=2, structured_outputs=_so(regex="[a-z]{3}[0-9]")))
        engine.add_request("fine", "Hi", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({out.request_id: out for out in engine.step() if out.finished})
    finally:
        restore()
    assert [c.finish_reason for c in finished["bad"].outputs] == ["error", "error"]
    assert finished["bad"].outputs[0].token_ids == []
    assert len(finished["fine"].outputs[0].token_ids) == 5
    _assert_pool_empty(llm)


def test_the_core_process_serves_structured_requests_and_goes_idle(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, max_model_len=512)
    allm = AsyncLLM.from_config(config)

    async def main():
        params = SamplingParams(seed=5, n=2, max_tokens=40, structured_outputs=_so(regex="[d-f]{4}"))
        outputs = [out async for out in allm.generate("r0", "Hi", params)]
        await allm.wait_idle()
        await allm.check_invariants()
        stats = await allm.stats()
        assert stats.num_unfinished_requests == 0 and stats.num_used_blocks == 0
        return outputs[-1]

    try:
        final = asyncio.run(main())
    finally:
        allm.close()
    assert all(re.fullmatch("[d-f]{4}", c.text) and c.finish_reason == "stop" for c in final.outputs)


def test_the_sampler_draws_only_allowed_tokens_and_reports_raw_logprobs():
    vocab, rows = 70, 3
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    allowed = [[5, 33, 64], [0, 31, 32, 69]]
    bitmask = np.zeros((2, 3), dtype=np.int32)
    for r, tokens in enumerate(allowed):
        for t in tokens:
            bitmask[r, t // 32] |= np.int32(1 << (t % 32)) if t % 32 < 31 else np.int32(-(1 << 31))
    params = [SamplingParams(temperature=0, logprobs=0), SamplingParams(temperature=1.0, logprobs=0),
              SamplingParams(temperature=0, logprobs=0)]
    sampling_rows = [SamplingRow(p, seed=i, sample_index=0, prompt_token_ids=(), output_token_ids=())
                     for i, p in enumerate(params)]
    md = SamplingMetadata.build(sampling_rows, vocab, "cpu", np.array([0, 1]), bitmask)
    out = Sampler()(logits, md)
    assert int(out.token_ids[0]) == max(allowed[0], key=lambda t: logits[0, t])
    assert int(out.token_ids[1]) in allowed[1]
    assert int(out.token_ids[2]) == int(logits[2].argmax())  # the unconstrained row
    expected = torch.log_softmax(logits, dim=1).gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    assert torch.allclose(out.logprobs, expected)
