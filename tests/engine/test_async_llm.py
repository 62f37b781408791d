"""AsyncLLM on its own: the engine on a thread, driven from asyncio. Results match the synchronous
engine, cancelled or dropped streams free their blocks, errors reach the caller, and an engine crash
fails every pending request instead of hanging it. No test sleeps: `wait_idle` and `stats` are
answered by the engine thread itself."""

from __future__ import annotations

import asyncio
import gc
import os

import pytest

from llmserve import LLM, SamplingParams
from llmserve.config import EngineConfig
from llmserve.engine.async_llm import AsyncLLM, EngineClosedError, EngineDeadError
from llmserve.errors import ContextLengthExceededError, InvalidRequestError
from tests import faulty_model

PROMPTS = ["The quick brown fox", "Once upon a time", "def fibonacci(n):", "Un café au lait. 日本語"]
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def _config(model_dir, **overrides) -> EngineConfig:
    kwargs = dict(dtype="float32", num_kv_blocks=64, max_model_len=512, max_num_batched_tokens=64)
    kwargs.update(overrides)
    return EngineConfig(model=str(model_dir), **kwargs)


@pytest.fixture(scope="module")
def allm(tiny_llama_dir):
    """One engine for the tests that leave it serving with nothing allocated (each checks so)."""
    engine = AsyncLLM.from_config(_config(tiny_llama_dir))
    yield engine
    engine.close()


@pytest.fixture
def own_allm(tiny_llama_dir):
    """An engine of the test's own, for tests that shut it down."""
    engine = AsyncLLM.from_config(_config(tiny_llama_dir))
    yield engine
    engine.close()


async def _collect(allm: AsyncLLM, request_id: str, prompt, params: SamplingParams):
    outputs = [out async for out in allm.generate(request_id, prompt, params)]
    assert outputs and outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    return outputs


async def _assert_pool_empty(allm: AsyncLLM) -> None:
    await allm.wait_idle()
    await allm.check_invariants()
    stats = await allm.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.num_unfinished_requests == 0
    assert stats.num_used_blocks == 0 and stats.num_free_blocks == stats.num_blocks
    assert allm.num_waiting == 0


def test_concurrent_requests_match_the_offline_engine(allm, tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = LLM(**vars(_config(tiny_llama_dir))).generate(PROMPTS, params)
    finished = allm.num_finished

    async def main():
        results = await asyncio.gather(*(_collect(allm, f"r{i}", p, params) for i, p in enumerate(PROMPTS)))
        await _assert_pool_empty(allm)
        return results

    results = asyncio.run(main())
    for outputs, want in zip(results, expected, strict=True):
        final = outputs[-1]
        assert final.outputs[0].token_ids == want.outputs[0].token_ids
        assert final.outputs[0].text == want.outputs[0].text
        assert final.prompt_token_ids == want.prompt_token_ids
        # outputs are cumulative: each one extends the previous
        texts = [o.outputs[0].text for o in outputs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert allm.num_finished - finished == len(PROMPTS)


def test_outputs_are_snapshots_the_engine_no_longer_mutates(allm):
    async def main():
        seen = []
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True)
        async for out in allm.generate("lp", "Hello", params):
            seen.append((out, len(out.outputs[0].token_ids), len(out.outputs[0].logprobs)))
        await _assert_pool_empty(allm)
        return seen

    for out, num_tokens, num_logprobs in asyncio.run(main()):
        assert num_tokens == num_logprobs
        assert len(out.outputs[0].token_ids) == num_tokens and len(out.outputs[0].logprobs) == num_logprobs


def test_cancelling_the_consumer_aborts_and_frees_blocks(allm):
    aborted, finished = allm.num_aborted, allm.num_finished

    async def consume(started: asyncio.Event):
        async for _ in allm.generate("cancel-me", "Hello there", LONG):
            started.set()

    async def main():
        started = asyncio.Event()
        task = asyncio.ensure_future(consume(started))
        await started.wait()
        assert (await allm.stats()).num_used_blocks > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _assert_pool_empty(allm)

    asyncio.run(main())
    assert allm.num_aborted - aborted == 1 and allm.num_finished == finished


def test_stopping_early_or_dropping_the_stream_aborts(allm):
    aborted = allm.num_aborted

    async def main():
        agen = allm.generate("early", "Hello", LONG)
        await agen.__anext__()
        await agen.aclose()  # the consumer stops early
        stream = await allm.add_request("dropped", "Hello", LONG)
        await stream.__anext__()
        del stream  # nobody reads it any more: its finalizer aborts it
        gc.collect()
        await _assert_pool_empty(allm)

    asyncio.run(main())
    assert allm.num_aborted - aborted == 2


def test_explicit_abort_and_many_streams_leave_nothing_allocated(allm):
    aborted = allm.num_aborted

    async def main():
        streams = [await allm.add_request(f"s{i}", PROMPTS[i % 4], LONG) for i in range(12)]
        for stream in streams[:6]:
            await stream.__anext__()
        for stream in streams:
            stream.abort()
        with pytest.raises(StopAsyncIteration):
            await streams[0].__anext__()
        await _assert_pool_empty(allm)

    asyncio.run(main())
    assert allm.num_aborted - aborted == 12


@pytest.mark.parametrize(
    ("prompt", "params", "error", "param"),
    [
        ("", SamplingParams(), InvalidRequestError, "prompt"),
        ([5] * 600, SamplingParams(), ContextLengthExceededError, "prompt"),
        ("hello", SamplingParams(max_tokens=600), ContextLengthExceededError, "max_tokens"),
        ([99999], SamplingParams(), InvalidRequestError, "prompt"),
    ],
)
def test_validation_errors_reach_the_caller_and_the_engine_keeps_serving(allm, prompt, params, error, param):
    async def main():
        good = asyncio.ensure_future(
            _collect(allm, "good", "Hello", SamplingParams(max_tokens=5, ignore_eos=True))
        )
        with pytest.raises(error) as info:
            async for _ in allm.generate("bad", prompt, params):
                pass
        assert info.value.param == param
        outputs = await good
        assert len(outputs[-1].outputs[0].token_ids) == 5
        await _assert_pool_empty(allm)

    asyncio.run(main())


def test_duplicate_request_id_is_refused_while_the_first_runs(allm):
    async def main():
        first = await allm.add_request("same", "Hello", LONG)
        with pytest.raises(InvalidRequestError):
            await allm.add_request("same", "Hello", LONG)
        first.abort()
        await _assert_pool_empty(allm)

    asyncio.run(main())


def test_num_waiting_counts_queued_requests(tiny_llama_dir):
    # max_num_seqs=1: one runs, the others wait in the engine's queue
    allm = AsyncLLM.from_config(_config(tiny_llama_dir, max_num_seqs=1))
    try:

        async def main():
            streams = [await allm.add_request(f"w{i}", "Hello", LONG) for i in range(4)]
            await streams[0].__anext__()
            stats = await allm.stats()
            assert stats.num_running == 1 and stats.num_waiting == 3
            assert allm.num_waiting == 3
            for stream in streams:
                stream.abort()
            await _assert_pool_empty(allm)

        asyncio.run(main())
    finally:
        allm.close()


def test_requests_on_their_way_to_the_core_wait_behind_a_new_one_of_an_earlier_priority(tiny_llama_dir):
    # Admission asks what a new request would wait behind. Requests the core has not reported yet count by
    # their own priority, as those in its queue do: a gold request is not refused for free ones still in transit.
    allm = AsyncLLM.from_config(_config(tiny_llama_dir, max_num_seqs=1, scheduling_policy="priority"))
    try:

        async def main():
            streams = [await allm.add_request(f"free{i}", "Hello", LONG, priority=10) for i in range(3)]
            assert allm.queue_ahead(-10)[0] == 0  # no await since the last was sent: it is still in transit
            assert allm.queue_ahead(10)[0] == allm.num_waiting > 0
            for stream in streams:
                stream.abort()
            await _assert_pool_empty(allm)

        asyncio.run(main())
    finally:
        allm.close()


async def _until_healthy(allm: AsyncLLM) -> None:
    """Poll, as a load balancer's health check would: the new core starts in another process."""
    while not allm.is_healthy:
        await asyncio.sleep(0.05)


@pytest.fixture
def faulty_engine(allm, tiny_llama_dir, tmp_path, monkeypatch):
    """An engine whose core process fails any step that computes FAULT_TOKEN. The plugin that makes it so is named
    in the environment after the forkserver cores fork from has started (`allm`'s core started it): each core takes
    on this process's environment of the moment it starts."""
    monkeypatch.setenv("LLMSERVE_PLUGINS", "tests.faulty_model")
    engine = AsyncLLM.from_config(_config(faulty_model.faulty_copy(tiny_llama_dir, tmp_path / "faulty")))
    yield engine
    engine.close()


def test_a_failing_step_fails_every_request_in_flight_and_a_new_core_serves_the_next(faulty_engine):
    allm = faulty_engine
    first_core = allm.engine_core_pid

    async def main():
        streams = [await allm.add_request(f"c{i}", "Hello", LONG) for i in range(3)]
        await streams[0].__anext__()  # all three are running
        poison = await allm.add_request("poison", [5, 6, faulty_model.FAULT_TOKEN], LONG)
        for stream in [*streams, poison]:
            with pytest.raises(EngineDeadError, match="injected fault"):
                async for _ in stream:
                    pass
        assert not allm.is_healthy
        with pytest.raises(EngineDeadError):
            await allm.add_request("while-dead", "Hello", LONG)
        await asyncio.wait_for(_until_healthy(allm), timeout=60)
        outputs = await _collect(allm, "after", "Hello", SamplingParams(max_tokens=5, ignore_eos=True))
        assert len(outputs[-1].outputs[0].token_ids) == 5
        await _assert_pool_empty(allm)

    asyncio.run(main())
    assert allm.num_restarts == 1 and allm.engine_core_pid != first_core
    assert allm.is_healthy and allm.dead_error is None


def test_shutdown_lets_running_requests_finish(own_allm):
    allm = own_allm

    async def main():
        stream = await allm.add_request("finishing", "Hello", SamplingParams(max_tokens=20, ignore_eos=True))
        shutdown = asyncio.ensure_future(allm.shutdown(timeout=60))
        await asyncio.sleep(0)  # let shutdown() close the door
        with pytest.raises(EngineClosedError):
            await allm.add_request("too-late", "Hello", LONG)
        outputs = [out async for out in stream]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 20
        await shutdown

    pid = allm.engine_core_pid
    asyncio.run(main())
    _assert_gone(pid)


def test_shutdown_lets_a_beam_search_finish_and_listeners_hear_of_it_once(own_allm):
    """A search's one-token steps go on through the drain; listeners (metrics) hear of the search, not its steps."""
    allm = own_allm
    heard: list[str] = []
    allm.add_listener(lambda events: heard.extend(output.request_id for output in events.outputs))
    params = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True, use_beam_search=True)

    async def main():
        stream = await allm.add_request("beams", [5, 6, 7, 8], params)
        shutdown = asyncio.ensure_future(allm.shutdown(timeout=60))
        await asyncio.sleep(0)  # let shutdown() close the door
        with pytest.raises(EngineClosedError):
            await allm.add_request("too-late", [5, 6], params)
        outputs = [out async for out in stream]
        assert len(outputs) == 1 and outputs[0].finished
        assert [len(choice.token_ids) for choice in outputs[0].outputs] == [24, 24]
        await shutdown

    asyncio.run(main())
    assert heard == ["beams"]


def test_shutdown_timeout_aborts_what_is_left(own_allm):
    allm = own_allm

    async def main():
        stream = await allm.add_request("endless", "Hello", SamplingParams(max_tokens=500, ignore_eos=True))
        await stream.__anext__()
        await allm.shutdown(timeout=0)
        with pytest.raises(EngineClosedError):
            async for _ in stream:
                pass
        stats = await allm.stats()  # the engine core is gone: the stats it sent last
        assert stats.num_used_blocks == 0 and stats.num_unfinished_requests == 0

    pid = allm.engine_core_pid
    asyncio.run(main())
    _assert_gone(pid)


def _assert_gone(pid: int | None) -> None:
    """The engine core process ended and was reaped: no process has its pid any more."""
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_engine_cores_started_at_once_all_start_with_passive_openmp_threads(tiny_llama_dir, monkeypatch):
    """`serve` loads its models on threads at once: every core starts, each with OMP_WAIT_POLICY=PASSIVE in its
    environment, and the variable is left as it was in this process."""
    import threading

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=16, max_model_len=256)
    ready = threading.Barrier(3)
    engines: list[AsyncLLM] = []
    failures: list[BaseException] = []

    def start() -> None:
        ready.wait()
        try:
            engines.append(AsyncLLM.from_config(config))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            failures.append(exc)

    threads = [threading.Thread(target=start) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    try:
        assert not failures and len(engines) == 3
        for engine in engines:
            with open(f"/proc/{engine.engine_core_pid}/environ", "rb") as environ:
                assert b"OMP_WAIT_POLICY=PASSIVE" in environ.read().split(b"\0")
        assert "OMP_WAIT_POLICY" not in os.environ
    finally:
        for engine in engines:
            engine.close()
