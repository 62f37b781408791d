"""Engine behaviour end to end on the tiny built-in model: no leaked blocks in any scenario, n > 1,
seeded sampling, stop conditions, logprobs, and bad input that leaves the engine serving."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys

import pytest

from llmserve import LLM, SamplingParams
from llmserve.config import EngineConfig
from llmserve.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    ModelLoadError,
    UnsupportedArchitectureError,
)
from llmserve.sampling import RequestOutputKind

PROMPTS = [
    "The quick brown fox",
    "In a distant galaxy, far away from here, there was",
    "def fibonacci(n):",
    "Once upon a time",
    "Un café au lait, s'il vous plaît. 日本語のテキスト",
]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=96, max_num_batched_tokens=64, max_model_len=1024)


def _drain(engine, until=None):
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        engine.check_invariants()
        if until is not None and until():
            break
    return outputs


def _first_outputs(engine):
    """Step until a step's tokens are in (with overlapped scheduling the first call only launches)."""
    while not (outputs := engine.step()):
        pass
    return outputs


def _assert_pool_empty(llm):
    engine = llm.engine
    engine.check_invariants()
    assert engine.core.block_manager.num_free_blocks == engine.core.block_manager.num_blocks
    assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0


def test_generate_returns_text_tokens_and_timings(llm):
    out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    tok = llm.get_tokenizer()
    for prompt, o in zip(PROMPTS, out, strict=True):
        assert o.prompt == prompt and o.prompt_token_ids == tok.encode(prompt)
        c = o.outputs[0]
        assert len(c.token_ids) == 12 and c.finish_reason == "length"
        assert c.text == tok.decode(c.token_ids)
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    _assert_pool_empty(llm)


def test_final_only_requests_report_once_and_generate_leaves_the_callers_params_alone(llm):
    engine = llm.engine
    every = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    once = dataclasses.replace(every, output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("every", "Once upon a time", every)
    engine.add_request("once", "Once upon a time", once)
    reports: dict[str, list] = {"every": [], "once": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            reports[out.request_id].append(out)
    assert len(reports["every"]) == 6 and [o.finished for o in reports["every"]] == [False] * 5 + [True]
    assert len(reports["once"]) == 1 and reports["once"][0].finished
    assert reports["once"][0].outputs[0].token_ids == reports["every"][-1].outputs[0].token_ids
    assert llm.generate(["Once upon a time"], every)[0].outputs[0].token_ids == reports["once"][0].outputs[0].token_ids
    assert every.output_kind is RequestOutputKind.CUMULATIVE
    _assert_pool_empty(llm)


def test_each_output_is_a_snapshot_that_later_steps_leave_alone(llm):
    engine = llm.engine
    engine.add_request("snap", "def fibonacci(n):", SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True))
    first = _first_outputs(engine)[0]  # the prompt fits one step: the first token comes with it
    frozen = (list(first.outputs[0].token_ids), len(first.outputs[0].logprobs), first.metrics.last_token_time)
    _drain(engine)
    assert frozen[:2] == ([first.outputs[0].token_ids[0]], 1)
    assert (list(first.outputs[0].token_ids), len(first.outputs[0].logprobs), first.metrics.last_token_time) == frozen
    assert first.metrics.finished_time is None
    _assert_pool_empty(llm)


def test_abort_mid_prefill_and_mid_decode_frees_every_block(llm):
    engine = llm.engine
    long_prompt = list(range(5, 305))  # 300 tokens: 5 steps of prefill at 64 tokens a step
    engine.add_request("prefill", long_prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("decode", "Hello there", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    prefill_seq = engine.core.scheduler.requests["prefill"].seqs[0]
    assert 0 < prefill_seq.num_computed_tokens < 300
    [aborted] = engine.abort_request("prefill")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    engine.check_invariants()
    for _ in range(3):
        engine.step()
    assert engine.core.scheduler.requests["decode"].seqs[0].num_output_tokens > 0
    engine.abort_request(["decode"])
    assert not engine.has_unfinished_requests()
    _assert_pool_empty(llm)


def test_n_greater_than_one_shares_prompt_blocks_and_leaks_nothing(llm):
    engine = llm.engine
    prompt = list(range(10, 50))  # 40 tokens: two full blocks of 16 and a partial one
    engine.add_request("n4", prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))
    _first_outputs(engine)  # prefill + first token of each choice, then the fork
    seqs = engine.core.scheduler.requests["n4"].seqs
    assert len(seqs) == 4
    shared = seqs[0].block_table[:2]
    for child in seqs[1:]:
        assert child.block_table[:2] == shared
    assert [engine.core.block_manager.ref_counts[b] for b in shared] == [4, 4]
    engine.check_invariants()
    outputs = _drain(engine)
    choices = outputs["n4"].outputs
    assert [c.index for c in choices] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in choices)
    assert len({tuple(c.token_ids) for c in choices}) > 1
    # choice 0 of a seeded n=4 request draws exactly what n=1 with the same seed draws
    single = llm.generate([prompt], SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True))[0]
    assert single.outputs[0].token_ids == choices[0].token_ids
    _assert_pool_empty(llm)


def test_seeded_sampling_is_the_same_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["Once upon a time"], params)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.7, seed=s, max_tokens=s + 3, ignore_eos=True) for s in range(6)]
    batch = llm.generate(PROMPTS + ["Once upon a time"] + PROMPTS[:1], others[:5] + [params, others[5]])
    assert batch[5].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=16, ignore_eos=True)
    assert llm.generate(["Once upon a time"], different_seed)[0].outputs[0].token_ids != alone
    _assert_pool_empty(llm)


def test_stop_string_spanning_token_boundaries_is_cut_from_the_text(llm):
    tok = llm.get_tokenizer()
    base = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    ids = base.outputs[0].token_ids
    # a stop string made of the end of token 3's text and the start of token 4's
    before = tok.decode(ids[:3])
    through = tok.decode(ids[:4])
    assert len(through) - len(before) >= 1 and len(before) >= 2
    stop = before[-2:] + through[len(before):len(before) + 1]
    expected_end = base.outputs[0].text.find(stop)
    out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == base.outputs[0].text[:expected_end]
    kept = llm.generate(
        ["The quick brown fox"],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
    )[0]
    assert kept.outputs[0].text == base.outputs[0].text[: expected_end + len(stop)]
    _assert_pool_empty(llm)


def test_stop_token_ids_min_tokens_and_logprobs(llm):
    base = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    ids = base.outputs[0].token_ids
    stop_id = ids[4]
    first = ids.index(stop_id)
    out = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]))[0]
    c = out.outputs[0]
    assert c.token_ids == ids[: first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_id
    # The stop token ends the choice without joining its text (vLLM's), whatever skip_special_tokens says.
    assert c.text == llm.get_tokenizer().decode(ids[:first])
    kept_specials = llm.generate(["def fibonacci(n):"], SamplingParams(
        temperature=0, max_tokens=10, stop_token_ids=[stop_id], skip_special_tokens=False))[0].outputs[0]
    assert kept_specials.text == c.text
    # min_tokens bans the stop token until enough tokens exist
    banned = llm.generate(
        ["def fibonacci(n):"],
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ids[0]], min_tokens=3),
    )[0].outputs[0]
    assert banned.token_ids[0] != ids[0] and len(banned.token_ids) >= 3
    lp = llm.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))[0]
    c = lp.outputs[0]
    assert len(c.logprobs) == 5
    for token, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert token in entry and len(entry) == 3  # greedy: the chosen token is the top one
        values = [lp.logprob for lp in entry.values()]
        assert entry[token].logprob == max(values) and all(v <= 0 for v in values)
        assert entry[token].rank == 1
    assert c.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True))
    )
    _assert_pool_empty(llm)


def test_each_token_records_where_its_text_ended_when_asked(llm):
    tokenizer = llm.get_tokenizer()
    free = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    stop = free.text[12:15]
    params = [SamplingParams(temperature=1.0, seed=7, max_tokens=48, ignore_eos=True, track_text_ends=True)
              for _ in PROMPTS]
    params[3] = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, track_text_ends=True, stop=[stop])
    outputs = [out.outputs[0] for out in llm.generate(PROMPTS, params)]
    assert outputs[3].finish_reason == "stop" and [c.finish_reason for c in outputs].count("length") == 4
    for c in outputs:
        ends = c.text_ends
        assert len(ends) == len(c.token_ids) and ends == sorted(ends)
        for i, end in enumerate(ends):
            assert c.tokens_within(end) >= i + 1 and c.tokens_within(end - 1) <= i
            # a token's text is out once it is whole: a piece of a character waits for what completes it
            assert len(tokenizer.decode(c.token_ids[: i + 1]).rstrip("\ufffd")) <= end
        if c.finish_reason == "length":
            assert ends[-1] == len(c.text) and c.tokens_within(len(c.text)) == len(c.token_ids)
        else:  # the tokens of the stop string made text past the end it was cut at
            assert ends[-1] > len(c.text) and c.tokens_within(len(c.text)) < len(c.token_ids)
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, logprobs=1))[0].outputs[0].text_ends is None
    _assert_pool_empty(llm)


def test_chat_applies_the_template(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert out.prompt_token_ids == llm.get_tokenizer().apply_chat_template(messages, tokenize=True)
    begun = [*messages, {"role": "assistant", "content": "Hello there"}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    continued = llm.chat(begun, params, add_generation_prompt=False, continue_final_message=True)[0]
    text = llm.get_tokenizer().decode(continued.prompt_token_ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\nHello there")
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        llm.chat(begun, params, continue_final_message=True)
    _assert_pool_empty(llm)


@pytest.mark.parametrize(
    ("prompt", "params", "error", "param"),
    [
        ("", {}, InvalidRequestError, "prompt"),
        ([5] * 3000, {}, ContextLengthExceededError, "prompt"),
        ("hello", {"max_tokens": 5000}, ContextLengthExceededError, "max_tokens"),
        ([99999], {}, InvalidRequestError, "prompt"),
    ],
)
def test_bad_prompts_raise_and_the_engine_keeps_serving(llm, prompt, params, error, param):
    engine = llm.engine
    engine.add_request("good", "Hello", SamplingParams(max_tokens=6, ignore_eos=True))
    with pytest.raises(error) as info:
        engine.add_request("bad", prompt, SamplingParams(**params))
    assert info.value.param == param
    outputs = _drain(engine)
    assert outputs["good"].finished and len(outputs["good"].outputs[0].token_ids) == 6
    _assert_pool_empty(llm)


@pytest.mark.parametrize(
    ("params", "param"),
    [({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"),
     ({"max_tokens": 0}, "max_tokens"), ({"top_k": -3}, "top_k"), ({"min_p": 2.0}, "min_p")],
)
def test_bad_sampling_params_name_the_parameter(params, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**params)
    assert info.value.param == param


def test_duplicate_request_id_is_rejected(llm):
    engine = llm.engine
    engine.add_request("dup", "Hi", SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError):
        engine.add_request("dup", "Hi", SamplingParams(max_tokens=2))
    _drain(engine)
    _assert_pool_empty(llm)


def _copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture_names_the_supported_ones(tiny_llama_dir, tmp_path):
    model = _copy_model(tiny_llama_dir, tmp_path / "m")
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["GPTBigCodeForCausalLM"]
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(model))


def test_missing_and_truncated_safetensors_fail_clearly(tiny_llama_dir, tmp_path):
    missing = _copy_model(tiny_llama_dir, tmp_path / "missing")
    for f in missing.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(str(missing))
    truncated = _copy_model(tiny_llama_dir, tmp_path / "truncated")
    weights = next(truncated.glob("*.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        LLM(str(truncated))


def test_hub_id_offline_fails_with_a_clear_message(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="could not be fetched from the Hugging Face hub"):
        LLM("meta-llama/Llama-3.1-8B-Instruct")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_engines_run_and_keep_greedy_tokens_on_the_tiny_model(tiny_llama_dir, dtype):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reference = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=32, max_model_len=256)
    half = LLM(str(tiny_llama_dir), dtype=dtype, num_kv_blocks=32, max_model_len=256)
    assert str(half.engine.core.runner.dtype) == f"torch.{dtype}"
    expected = reference.generate(PROMPTS[:2], params)
    got = half.generate(PROMPTS[:2], params)
    # Half precision may flip a near-tie later on, but the first greedy token of each prompt is clear-cut.
    assert [o.outputs[0].token_ids[0] for o in got] == [o.outputs[0].token_ids[0] for o in expected]
    assert all(len(o.outputs[0].token_ids) == 8 for o in got)
    _assert_pool_empty(half)


def test_cpu_threads_sets_the_threads_an_engine_computes_with(tiny_llama_dir):
    """In a process of its own: the offline engine computes in the caller's process, whose threads it sets."""
    script = (f"from llmserve import LLM; import torch; LLM({str(tiny_llama_dir)!r}, cpu_threads=1, device='cpu', "
              "num_kv_blocks=8, max_model_len=128); print(torch.get_num_threads())")
    answer = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert answer.stdout.strip().splitlines()[-1] == "1"
    with pytest.raises(ValueError, match="cpu_threads must be at least 1"):
        EngineConfig(model=str(tiny_llama_dir), cpu_threads=0).validate()
