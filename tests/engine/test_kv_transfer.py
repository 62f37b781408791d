"""Prefill/decode disaggregation between two engines in this process, over their real ZeroMQ side
channels: the decode engine's answers equal a plain engine's token for token while it computes only the
prompt's last block; a failed pull (expired, pulled twice, gone, other tokens, another layout) costs
only the compute; held blocks are let go after the pull or the TTL, and no block leaks on either side."""

from __future__ import annotations

import time

import pytest

from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.messages import KVTransferParams
from llmserve.errors import InvalidRequestError
from llmserve.outputs import RequestOutput
from llmserve.sampling.params import SamplingParams

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PREFILL = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(150)]  # 9 full blocks and 6 tokens


def _engine(model_dir, **overrides) -> LLMEngine:
    kwargs = dict(dtype="float32", num_kv_blocks=64, max_model_len=512, max_num_batched_tokens=256,
                  block_size=BLOCK, kv_transfer=True, kv_transfer_host="127.0.0.1")
    kwargs.update(overrides)
    return LLMEngine(EngineConfig(model=str(model_dir), **kwargs))


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    prefill, decode = _engine(tiny_llama_dir), _engine(tiny_llama_dir)
    yield prefill, decode
    for engine in (prefill, decode):
        engine.core.shutdown()


def _run(engine: LLMEngine, request_id: str, prompt, params: SamplingParams,
         kv_transfer: KVTransferParams | None = None) -> RequestOutput:
    engine.add_request(request_id, prompt, params, kv_transfer=kv_transfer)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                final = output
    assert final is not None
    return final


def _export(prefill: LLMEngine, request_id: str, prompt) -> dict:
    output = _run(prefill, request_id, prompt, PREFILL, KVTransferParams(do_remote_decode=True))
    params = output.kv_transfer_params
    assert params is not None and params["remote_port"] == prefill.core.kv_transfer.port
    return params


def _remote(params: dict) -> KVTransferParams:
    return KVTransferParams(do_remote_prefill=True, transfer_id=params["transfer_id"], remote_host="127.0.0.1",
                            remote_port=params["remote_port"])


def _computed_prompt_tokens(engine: LLMEngine, run) -> int:
    """Prompt tokens the engine's steps computed while `run()` ran."""
    computed = 0
    step = engine.core.step

    def counting_step():
        nonlocal computed
        outputs = step()
        if engine.core.last_step is not None and outputs is not None:
            computed += engine.core.last_step.num_prefill_tokens
        return outputs

    engine.core.step = counting_step
    try:
        run()
    finally:
        del engine.core.step
    return computed


def _assert_no_leak(*engines: LLMEngine) -> None:
    for engine in engines:
        engine.core.release_kv_exports()
        engine.check_invariants()
        stats = engine.stats()
        assert stats.num_used_blocks == 0 and stats.kv_blocks_held == 0


def test_the_decode_engine_answers_as_one_engine_and_computes_only_the_last_block(engines, tiny_llama_dir):
    prefill, decode = engines
    plain = _engine(tiny_llama_dir, kv_transfer=False)
    want = _run(plain, "plain", PROMPT, GREEDY).outputs[0].token_ids
    plain.core.shutdown()

    params = _export(prefill, "p1", PROMPT)
    assert params["num_tokens"] == 9 * BLOCK
    assert prefill.stats().kv_blocks_held == 9  # held for the pull, though the request ended
    prefill.check_invariants()
    sent_before, received_before = prefill.stats().kv_blocks_sent, decode.stats().kv_blocks_received

    result: list[RequestOutput] = []
    computed = _computed_prompt_tokens(decode, lambda: result.append(_run(decode, "d1", PROMPT, GREEDY, _remote(params))))
    assert result[0].outputs[0].token_ids == want
    assert computed == len(PROMPT) - 9 * BLOCK  # the 6 tokens past the last full block, nothing else
    assert result[0].num_cached_tokens == 0  # pulled KV is not billed as a cache hit
    assert prefill.stats().kv_blocks_sent - sent_before == 9
    assert decode.stats().kv_blocks_received - received_before == 9
    _assert_no_leak(prefill, decode)


def test_only_the_blocks_the_decode_engine_lacks_are_pulled(engines):
    prefill, decode = engines
    shared = [5 + i % 200 for i in range(64)]  # 4 blocks both requests start with
    _run(decode, "warm", shared + [1, 2, 3], GREEDY)  # the decode engine has them cached now
    prompt = shared + [(3 * i) % 240 + 2 for i in range(70)]
    params = _export(prefill, "p2", prompt)
    received = decode.stats().kv_blocks_received
    _run(decode, "d2", prompt, GREEDY, _remote(params))
    assert decode.stats().kv_blocks_received - received == (len(prompt) - 1) // BLOCK - 4
    _assert_no_leak(prefill, decode)


def test_a_transfer_is_pulled_once_and_a_second_pull_computes_its_prompt(engines):
    prefill, decode = engines
    prompt = [(11 * i) % 230 + 4 for i in range(100)]
    params = _export(prefill, "p3", prompt)
    first = _run(decode, "d3", prompt, GREEDY, _remote(params)).outputs[0].token_ids
    decode.core.block_manager.reset_prefix_cache()  # nothing cached: a second pull would be needed in full
    failed = decode.stats().kv_pulls_failed
    computed = _computed_prompt_tokens(
        decode, lambda: _run(decode, "d3-again", prompt, GREEDY, _remote(params))
    )
    assert decode.stats().kv_pulls_failed == failed + 1
    assert computed == len(prompt)  # computed here, whole
    assert _run(decode, "d3-check", prompt, GREEDY).outputs[0].token_ids == first
    _assert_no_leak(prefill, decode)


def test_unpulled_kv_is_let_go_after_its_ttl(tiny_llama_dir):
    prefill = _engine(tiny_llama_dir, kv_transfer_ttl=0.2)
    try:
        _export(prefill, "p4", PROMPT)
        assert prefill.stats().kv_blocks_held == 9
        prefill.core.kv_transfer.release_done(prefill.core.block_manager, now=time.monotonic() + 0.3)
        stats = prefill.stats()
        assert stats.kv_blocks_held == 0 and stats.kv_exports_expired == 1 and stats.num_used_blocks == 0
        prefill.check_invariants()
    finally:
        prefill.core.shutdown()


def test_a_pull_from_nowhere_or_of_other_tokens_or_layout_falls_back_to_computing(engines, tiny_llama_dir):
    prefill, decode = engines
    want = _run(decode, "d5-plain", PROMPT[:120], GREEDY).outputs[0].token_ids
    decode.core.block_manager.reset_prefix_cache()
    failed = decode.stats().kv_pulls_failed
    # Nobody listens there: the connection is refused quietly by ZeroMQ, so the pull times out; a short
    # timeout keeps the test quick.
    from llmserve.engine import kv_transfer
    timeout, kv_transfer.PULL_TIMEOUT_S = kv_transfer.PULL_TIMEOUT_S, 0.3
    try:
        nowhere = KVTransferParams(do_remote_prefill=True, transfer_id="00", remote_host="127.0.0.1", remote_port=9)
        assert _run(decode, "d5-nowhere", PROMPT[:120], GREEDY, nowhere).outputs[0].token_ids == want
    finally:
        kv_transfer.PULL_TIMEOUT_S = timeout
    # Other tokens: the prefill engine held another prompt under this transfer id.
    decode.core.block_manager.reset_prefix_cache()
    other = _export(prefill, "p5", [t + 1 for t in PROMPT[:120]])
    assert _run(decode, "d5-other", PROMPT[:120], GREEDY, _remote(other)).outputs[0].token_ids == want
    # Another layout (a float16 KV cache): the prefill engine refuses to send.
    bf16 = _engine(tiny_llama_dir, dtype="bfloat16")
    try:
        held = _export(bf16, "p5-bf16", PROMPT[:120])
        decode.core.block_manager.reset_prefix_cache()
        assert _run(decode, "d5-layout", PROMPT[:120], GREEDY, _remote(held)).outputs[0].token_ids == want
        assert bf16.stats().kv_blocks_sent == 0
    finally:
        bf16.core.shutdown()
    assert decode.stats().kv_pulls_failed == failed + 3
    _assert_no_leak(prefill, decode)


def test_an_aborted_pulling_request_takes_nothing(engines):
    prefill, decode = engines
    params = _export(prefill, "p6", PROMPT)
    decode.add_request("d6", PROMPT, GREEDY, kv_transfer=_remote(params))
    decode.abort_request("d6")
    decode.core.wait_for_pending(timeout=0)  # nothing awaited any more: returns at once
    assert not decode.has_unfinished_requests()
    prefill.core.kv_transfer.release_done(prefill.core.block_manager, now=time.monotonic() + 60)
    _assert_no_leak(prefill, decode)


def test_requests_the_engine_cannot_transfer_are_refused(engines, tiny_llama_dir):
    prefill, _ = engines
    cases = [
        (KVTransferParams(), "exactly one"),
        (KVTransferParams(do_remote_decode=True, do_remote_prefill=True), "exactly one"),
        (KVTransferParams(do_remote_prefill=True, transfer_id="ab"), "remote_host, remote_port"),
    ]
    for params, message in cases:
        with pytest.raises(InvalidRequestError, match=message) as caught:
            prefill.add_request("bad", PROMPT, GREEDY, kv_transfer=params)
        assert caught.value.param == "kv_transfer_params"
    with pytest.raises(InvalidRequestError, match="n = 1"):
        prefill.add_request("bad", PROMPT, SamplingParams(n=2, max_tokens=1), kv_transfer=KVTransferParams(do_remote_decode=True))
    plain = _engine(tiny_llama_dir, kv_transfer=False)
    try:
        with pytest.raises(InvalidRequestError, match="--kv-transfer"):
            plain.add_request("bad", PROMPT[:20], GREEDY, kv_transfer=KVTransferParams(do_remote_decode=True))
    finally:
        plain.core.shutdown()
    assert not prefill.has_unfinished_requests()


@pytest.mark.parametrize("overrides, message", [
    ({"enable_prefix_caching": False}, "prefix caching"),
    ({"kv_transfer_port": 70000}, "TCP port"),
    ({"kv_transfer_ttl": 0}, "positive"),
])
def test_configs_that_cannot_transfer_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="x", kv_transfer=True, **overrides).validate()


def test_held_kv_never_takes_more_than_half_the_pool(tiny_llama_dir):
    prefill = _engine(tiny_llama_dir, num_kv_blocks=32)  # 16 blocks may be held: one 9-block prompt, not two
    try:
        assert _export(prefill, "p7", PROMPT)["num_tokens"] == 9 * BLOCK
        second = _run(prefill, "p7-more", [t + 2 for t in PROMPT], PREFILL, KVTransferParams(do_remote_decode=True))
        assert second.kv_transfer_params is None and second.finished  # answered, without a transfer
        assert prefill.stats().kv_blocks_held == 9
        prefill.check_invariants()
    finally:
        prefill.core.shutdown()


def test_malformed_pulls_are_answered_and_the_next_pull_is_served(engines):
    import msgspec
    import zmq

    from llmserve.engine.kv_transfer import KVPull, KVPullReply

    prefill, decode = engines
    params = _export(prefill, "p8", PROMPT)
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(f"tcp://127.0.0.1:{params['remote_port']}")
    try:
        layout = prefill.core.kv_transfer.layout
        for message in (b"\xc1 not msgpack", msgspec.msgpack.encode(["x", "y"]),
                        msgspec.msgpack.encode(KVPull(params["transfer_id"], 5, 99, layout)),  # past the held blocks
                        msgspec.msgpack.encode(KVPull(params["transfer_id"], 0, 1, "another layout")),
                        msgspec.msgpack.encode(KVPull(params["transfer_id"], 0, 1, layout, adapter="sql-lora"))):
            socket.send(message)
            assert socket.poll(5000)
            reply = msgspec.msgpack.decode(socket.recv_multipart()[0], type=KVPullReply)
            assert reply.error
    finally:
        socket.close()
    decode.core.block_manager.reset_prefix_cache()  # the whole prompt is pulled
    before = decode.stats()
    result = _run(decode, "d8", PROMPT, GREEDY, _remote(params))  # the transfer is still there, whole
    after = decode.stats()
    assert after.kv_pulls_failed == before.kv_pulls_failed
    assert after.kv_blocks_received == before.kv_blocks_received + 9
    assert result.outputs[0].token_ids == _run(decode, "d8-again", PROMPT, GREEDY).outputs[0].token_ids
    _assert_no_leak(prefill, decode)


def test_frames_of_the_wrong_size_are_refused_before_any_write(engines):
    _, decode = engines
    runner = decode.core.runner
    with pytest.raises(ValueError, match="other sizes"):
        runner.write_kv_blocks([0], [memoryview(b"\0" * 8)] * runner.num_kv_frames)
    with pytest.raises(ValueError, match="frames for"):
        runner.write_kv_blocks([0], [memoryview(b"\0" * 8)])


def test_blocks_evicted_for_pulled_kv_are_saved_to_the_tier_as_they_were(engines, tiny_llama_dir):
    prefill, _ = engines
    decode = _engine(tiny_llama_dir, num_kv_blocks=24, max_model_len=256, kv_offload_gib=0.01)
    try:
        first = [(3 * i + 1) % 240 + 5 for i in range(150)]
        want = _run(decode, "x", first, GREEDY).outputs[0].token_ids
        _run(decode, "y", [(5 * i + 2) % 240 + 5 for i in range(150)], GREEDY)  # the pool is all named now
        params = _export(prefill, "p9", PROMPT)
        _run(decode, "d9", PROMPT, GREEDY, _remote(params))  # its 9 pulled blocks evict x's (saved first)
        _run(decode, "z", [(7 * i + 4) % 240 + 5 for i in range(150)], GREEDY)
        again = _run(decode, "x-again", first, GREEDY)
        assert decode.stats().kv_offload_loaded > 0  # x came back from the tier...
        assert again.outputs[0].token_ids == want  # ...with its own KV, not the pulled blocks'
        decode.check_invariants()
    finally:
        decode.core.shutdown()


def test_blocks_the_tier_holds_are_not_pulled(engines, tiny_llama_dir):
    prefill, _ = engines
    decode = _engine(tiny_llama_dir, num_kv_blocks=24, max_model_len=256, kv_offload_gib=0.01)
    try:
        shared = [5 + (3 * i) % 200 for i in range(64)]  # 4 blocks
        _run(decode, "warm", shared + [1, 2, 3], GREEDY)
        for k in range(3):  # evict them from the pool into the tier
            _run(decode, f"other-{k}", [(13 * i + 5 * k) % 240 + 2 for i in range(150)], GREEDY)
        prompt = shared + [(9 * i) % 230 + 7 for i in range(70)]
        want = _run(prefill, "p10-plain", prompt, GREEDY).outputs[0].token_ids
        params = _export(prefill, "p10", prompt)
        received, loaded = decode.stats().kv_blocks_received, decode.stats().kv_offload_loaded
        got = _run(decode, "d10", prompt, GREEDY, _remote(params)).outputs[0].token_ids
        assert got == want
        assert decode.stats().kv_blocks_received - received == (len(prompt) - 1) // BLOCK - 4
        assert decode.stats().kv_offload_loaded - loaded == 4
        decode.check_invariants()
    finally:
        decode.core.shutdown()
