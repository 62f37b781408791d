"""Resumable streams shared through Redis (server/shared_streams.py), on the real Redis: two registries stand for
two processes sharing it. What one produces, the other follows from any event id (the events already made, then
the live ones), stops, and keeps alive past the grace period by following it; the copy keeps the producer's bounds
and is gone with the stream; a Redis that is down costs the stream nothing, and one back empty gets the copy again."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import redis
import redis.asyncio
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from llmserve.engine.async_llm import AsyncLLM
from llmserve.gateway.app import build_gateway_app
from llmserve.server.app import ModelSpec, build_app
from llmserve.server.errors import APIError
from llmserve.server.shared_streams import READ_BLOCK_MS, StreamMirror, stream_registry
from llmserve.server.streaming import SSE_DONE, EventsDropped, ResumeLimits, StreamRegistry
from tests.server.platform_fixtures import REDIS_URL, redis_or_skip
from tests.server.test_stream_buffer import Source, datas, drain

DEAD_REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
T = TypeVar("T")


@pytest.fixture
def prefix() -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    client = redis_or_skip()
    name = f"llmserve-test:{uuid.uuid4().hex[:12]}:"
    yield name
    for key in client.scan_iter(f"{name}*"):
        client.delete(key)
    client.close()


def two_processes(prefix: str, limits: ResumeLimits | None = None) -> tuple[StreamRegistry, StreamRegistry]:
    limits = limits or ResumeLimits()
    return tuple(StreamRegistry(limits, StreamMirror(REDIS_URL, limits, prefix)) for _ in range(2))


async def until(condition: Callable[[], Awaitable[bool] | bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        result = condition()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def on_redis(ask: Callable[[redis.Redis], T], url: str = REDIS_URL) -> T:
    """What `ask` reads with a client of its own (the registries' clients belong to their event loop)."""
    client = redis.Redis.from_url(url)
    try:
        return ask(client)
    finally:
        client.close()


def keys_of(prefix: str) -> list[str]:
    return on_redis(lambda client: sorted(key.decode() for key in client.scan_iter(f"{prefix}*")))


def test_another_process_follows_a_stream_from_any_event_then_live(prefix: str):
    async def main():
        here, there = two_processes(prefix)
        source = Source()
        stream = here.open("s1", "key-a", source.events())
        for data in "ab":
            source.put(data)
        await until(lambda: stream.next_number == 2)
        remote = await there.get("s1", "key-a")
        from_start = asyncio.ensure_future(drain(remote.follow()))
        after_first = asyncio.ensure_future(drain(remote.follow(last_event=0)))
        for data in "cd":
            source.put(data)
        source.end()
        local = await drain(stream.follow())
        results = await from_start, await after_first
        await here.close()
        await there.close()
        return local, *results

    local, from_start, after_first = asyncio.run(main())
    assert datas(local) == ["a", "b", "c", "d", "[DONE]"]
    assert from_start == local and after_first == local[1:]


def test_a_stream_is_found_elsewhere_only_by_its_owner_and_only_while_kept(prefix: str):
    async def main():
        limits = ResumeLimits(grace_seconds=0.3)
        here, there = two_processes(prefix, limits)
        source = Source()
        stream = here.open("s1", "key-a", source.events())
        source.put("a")
        await until(lambda: stream.next_number == 1)
        await until(lambda: bool(keys_of(prefix)))
        refusals = []
        for stream_id, owner in (("s1", "key-b"), ("s1", None), ("unknown", "key-a")):
            with pytest.raises(APIError) as refused:
                await there.get(stream_id, owner)
            refusals.append(refused.value.status)
        source.end()
        await stream.wait_finished()
        await until(lambda: not keys_of(prefix))  # forgotten in Redis a grace period after its end, as here
        with pytest.raises(APIError) as forgotten:
            await there.get("s1", "key-a")
        await here.close()
        await there.close()
        return refusals, forgotten.value.status

    refusals, forgotten = asyncio.run(main())
    assert refusals == [404, 404, 404] and forgotten == 404


def test_stopped_from_another_process_the_generation_ends(prefix: str):
    async def main():
        here, there = two_processes(prefix)
        closed = asyncio.Event()

        async def endless() -> AsyncIterator[str]:
            try:
                number = 0
                while True:
                    yield f"id: {number}\ndata: {number}\n\n"
                    number += 1
                    await asyncio.sleep(0.005)
            finally:
                closed.set()  # the producer was cancelled: the engine request is aborted there

        stream = here.open("s1", None, endless())
        follower = asyncio.ensure_future(drain(stream.follow()))
        await until(lambda: stream.next_number > 5)
        await (await there.get("s1", None)).stop()
        stopped = closed.is_set()
        copy = keys_of(prefix)
        events = await follower
        remaining = len(here)
        await here.close()
        await there.close()
        return stopped, copy, events, remaining

    stopped, copy, events, remaining = asyncio.run(main())
    assert stopped and copy == [] and remaining == 0
    assert datas(events) == [str(n) for n in range(len(events))]


def test_a_closing_process_leaves_its_finished_streams_to_the_others_until_they_expire(prefix: str):
    async def main():
        grace = 1.0
        here, there = two_processes(prefix, ResumeLimits(grace_seconds=grace))
        finished_source, live_source = Source(), Source()
        finished = here.open("finished", None, finished_source.events())
        here.open("live", None, live_source.events())
        finished_source.put("a")
        finished_source.end()
        live_source.put("b")
        await finished.wait_finished()
        await until(lambda: len(_entries(prefix, "finished")) == 3 and len(_entries(prefix, "live")) == 1)
        await here.close()  # stops the live one
        kept = keys_of(prefix)
        events = await drain((await there.get("finished", None)).follow())
        ttl_ms = on_redis(lambda client: client.pttl(f"{prefix}finished"))
        await there.close()
        return kept, events, ttl_ms

    kept, events, ttl_ms = asyncio.run(main())
    assert kept == [f"{prefix}finished", f"{prefix}finished:events"]
    assert datas(events) == ["a", "[DONE]"] and 0 < ttl_ms <= 1000


def test_a_follower_elsewhere_keeps_an_unfollowed_stream_alive_past_its_grace_period(prefix: str):
    async def main():
        grace = 0.3
        here, there = two_processes(prefix, ResumeLimits(grace_seconds=grace))
        source = Source()
        stream = here.open("s1", None, source.events())
        source.put("a")
        await until(lambda: bool(_entries(prefix, "s1")))
        remote = await there.get("s1", None)
        follower = asyncio.ensure_future(drain(remote.follow()))
        await asyncio.sleep(READ_BLOCK_MS / 1000 + 4 * grace)  # renewals of its presence there, none here
        alive_while_followed = not stream.producer.done()
        follower.cancel()  # the follower elsewhere leaves too
        await until(lambda: stream.producer.done(), timeout=4 * grace + 2 * READ_BLOCK_MS / 1000 + 2)
        aborted = stream.producer.cancelled()
        await here.close()
        await there.close()
        return alive_while_followed, aborted

    alive_while_followed, aborted = asyncio.run(main())
    assert alive_while_followed and aborted


def test_the_copy_keeps_what_the_buffer_keeps(prefix: str):
    async def main():
        here, there = two_processes(prefix, ResumeLimits(max_chars=60))
        source = Source()
        stream = here.open("s1", None, source.events())
        for i in range(10):
            source.put(f"event-{i}")  # "id: i\ndata: event-i\n\n": 23 characters
        source.end()
        await stream.wait_finished()
        await until(lambda: _entries(prefix, "s1") == ["0-10", "0-11", "0-12"])  # events 9 and 10 ([DONE]), the end
        remote = await there.get("s1", None)
        with pytest.raises(EventsDropped):
            remote.check_resumable_after(0)
        tail = await drain(remote.follow(last_event=8))
        behind = await drain(remote.follow(last_event=0))  # followed from a dropped event all the same
        await here.close()
        await there.close()
        return tail, behind

    tail, behind = asyncio.run(main())
    assert datas(tail) == ["event-9", "[DONE]"]
    assert json.loads(datas(behind)[0])["error"]["code"] == "stream_events_dropped" and behind[1] == SSE_DONE


def _entries(prefix: str, stream_id: str) -> list[str]:
    return on_redis(lambda client: [entry_id.decode() for entry_id, _ in client.xrange(f"{prefix}{stream_id}:events")])


def test_a_background_response_stream_is_not_stopped_from_elsewhere(prefix: str):
    async def main():
        here, there = two_processes(prefix)
        source = Source()
        stream = here.open("resp_1", None, source.events(), outlives_followers=True)
        source.put("a")
        await until(lambda: bool(_entries(prefix, "resp_1")))
        remote = await there.get("resp_1", None)
        client = redis.asyncio.Redis.from_url(REDIS_URL)
        await client.publish(there.mirror.stop_channel, "resp_1")  # what a stop from there would ask
        await client.aclose()
        source.put("b")
        source.end()
        await stream.wait_finished()
        events = await drain(remote.follow())
        await here.close()
        await there.close()
        return remote.outlives_followers, stream.producer.cancelled(), events

    outlives, cancelled, events = asyncio.run(main())
    assert outlives and not cancelled and datas(events) == ["a", "b", "[DONE]"]


def test_with_redis_down_the_stream_still_runs_here_and_a_resume_elsewhere_is_a_503():
    metrics = [CollectorRegistry(), CollectorRegistry()]  # each process's failures are counted

    async def main():
        here, there = (stream_registry(None, DEAD_REDIS_URL, registry) for registry in metrics)
        source = Source()
        stream = here.open("s1", None, source.events())
        for data in "ab":
            source.put(data)
        source.end()
        events = await asyncio.wait_for(drain(stream.follow()), 5)
        with pytest.raises(APIError) as unavailable:
            await there.get("s1", None)
        await here.close()
        await there.close()
        return events, unavailable.value

    events, unavailable = asyncio.run(main())
    assert datas(events) == ["a", "b", "[DONE]"]
    assert unavailable.status == 503 and unavailable.code == "stream_store_unavailable"
    assert _errors(metrics[0], "copy") >= 1 and _errors(metrics[0], "lookup") == 0
    assert _errors(metrics[1], "lookup") == 1 and _errors(metrics[1], "copy") == 0


def _errors(registry: CollectorRegistry, operation: str) -> float:
    return registry.get_sample_value("llmserve:shared_stream_errors_total", {"operation": operation}) or 0.0


@pytest.mark.parametrize("app_kind", ["serve", "gateway"])
def test_the_apps_count_the_shared_stores_failures_on_their_metrics(app_kind: str):
    over = threading.Event()

    def still_loading() -> AsyncLLM:  # the stream routes need no model
        over.wait()
        raise RuntimeError("the test is over")

    if app_kind == "serve":
        app = build_app(models=[ModelSpec("m", load=still_loading)], shared_streams_url=DEAD_REDIS_URL)
    else:
        app = build_gateway_app({"m": ["http://127.0.0.1:1"]}, shared_streams_url=DEAD_REDIS_URL)
    with TestClient(app) as client:
        try:
            for _ in range(2):
                resumed = client.get("/v1/streams/chatcmpl-elsewhere")
                assert resumed.status_code == 503 and resumed.headers["retry-after"] == "1"
                assert resumed.json()["error"]["code"] == "stream_store_unavailable"
            scraped = client.get("/metrics").text
        finally:
            over.set()  # before the app's shutdown, which waits for its loading models
    assert 'llmserve:shared_stream_errors_total{operation="lookup"} 2.0' in scraped.splitlines()


class OwnRedis:
    """A Redis server of a test's own, on a free port, that the test stops and starts again (empty)."""

    def __init__(self, binary: str, directory: Path) -> None:
        self.binary, self.directory = binary, directory
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--save", "", "--appendonly", "no",
                                      "--dir", str(self.directory)], stdout=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.01)
        client.close()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[OwnRedis]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    server = OwnRedis(binary, tmp_path)
    yield server
    server.kill()


def test_a_redis_restarted_empty_gets_the_whole_buffer_copied_again(own_redis: OwnRedis):
    """The copy is written again when Redis comes back without it (a restart, a failover to an empty replica):
    everything the producer still buffers, and what it made meanwhile."""
    own_redis.start()

    async def main():
        limits = ResumeLimits()
        here, there = (StreamRegistry(limits, StreamMirror(own_redis.url, limits)) for _ in range(2))
        source = Source()
        stream = here.open("s1", None, source.events())
        source.put("a")
        await until(lambda: _event_count(own_redis.url, "llmserve:stream:s1:events") == 1)
        own_redis.kill()
        source.put("b")  # made while Redis is down
        await until(lambda: stream.next_number == 2)
        own_redis.start()  # back, empty
        source.put("c")
        source.end()
        await until(lambda: _event_count(own_redis.url, "llmserve:stream:s1:events") == 5, timeout=15)
        events = await drain((await there.get("s1", None)).follow())
        await here.close()
        await there.close()
        return events

    assert datas(asyncio.run(main())) == ["a", "b", "c", "[DONE]"]


def _event_count(url: str, key: str) -> int:
    try:
        return on_redis(lambda client: client.xlen(key), url)
    except redis.ConnectionError:  # not started again yet
        return 0
