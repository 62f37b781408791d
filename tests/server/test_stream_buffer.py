"""The resumable streams' buffer on its own (no engine): followers from any event id, live events in
order, the bounds per stream and over all streams, and a producer that fails."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from llmserve.server.errors import APIError
from llmserve.server.streaming import SSE_DONE, EventIds, EventsDropped, ResumeLimits, StreamRegistry


class Source:
    """Events fed by the test: `put` one, `end` the stream, or `fail` it."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[str | BaseException | None] = asyncio.Queue()
        self.ids = EventIds()

    def put(self, data: str) -> None:
        self.queue.put_nowait(self.ids(f"data: {data}\n\n"))

    def end(self) -> None:
        self.queue.put_nowait(self.ids(SSE_DONE))
        self.queue.put_nowait(None)

    def fail(self) -> None:
        self.queue.put_nowait(RuntimeError("boom"))

    async def events(self) -> AsyncIterator[str]:
        while (item := await self.queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item


async def drain(events: AsyncIterator[str]) -> list[str]:
    return [event async for event in events]


def datas(events: list[str]) -> list[str]:
    return [event.split("data: ", 1)[1].rstrip("\n") for event in events]


def test_followers_get_the_events_after_their_id_then_the_live_ones_in_order():
    async def main():
        registry = StreamRegistry()
        source = Source()
        stream = registry.open("s1", None, source.events())
        source.put("a")
        source.put("b")
        early = asyncio.ensure_future(drain(stream.follow()))
        late = asyncio.ensure_future(drain(stream.follow(last_event=0)))
        for data in "cd":
            source.put(data)
        source.end()
        return await early, await late, stream

    early, late, stream = asyncio.run(main())
    assert datas(early) == ["a", "b", "c", "d", "[DONE]"]
    assert early[1:] == late and late[0].startswith("id: 1\n")
    assert stream.finished and stream.next_number == 5


def test_a_stream_keeps_only_its_newest_events_within_max_chars():
    async def main():
        registry = StreamRegistry(ResumeLimits(max_chars=60))
        source = Source()
        stream = registry.open("s1", None, source.events())
        for i in range(10):
            source.put(f"event-{i}")  # "id: i\ndata: event-i\n\n": 23 characters
        source.end()
        await stream.wait_finished()
        with pytest.raises(EventsDropped):
            stream.check_resumable_after(0)
        behind = await drain(stream.follow(last_event=0))
        tail = await drain(stream.follow(last_event=stream.first_kept - 1))
        return stream, registry, behind, tail

    stream, registry, behind, tail = asyncio.run(main())
    assert stream.chars <= 60 and stream.first_kept == 9 and registry.chars == stream.chars
    assert json.loads(datas(behind)[0])["error"]["code"] == "stream_events_dropped" and behind[1] == SSE_DONE
    assert datas(tail) == ["event-9", "[DONE]"]


def test_over_the_total_the_oldest_finished_streams_are_forgotten():
    async def main():
        registry = StreamRegistry(ResumeLimits(max_total_chars=100))
        finished = []
        for name in ("old", "newer"):
            source = Source()
            stream = registry.open(name, None, source.events())
            for _ in range(3):
                source.put("x" * 10)  # 21 characters each, with the done event 84 a stream
            source.end()
            await stream.wait_finished()
            finished.append(stream)
        live_source = Source()
        live = registry.open("live", None, live_source.events())
        names = [name for name in ("old", "newer", "live") if name in registry._streams]
        live_source.end()
        await live.wait_finished()
        return names, registry

    names, registry = asyncio.run(main())
    assert names == ["newer", "live"]
    assert registry.chars == sum(s.chars for s in registry._streams.values())


def test_a_failing_producer_ends_its_followers_with_an_error_event():
    async def main():
        registry = StreamRegistry()
        source = Source()
        stream = registry.open("s1", None, source.events())
        follower = asyncio.ensure_future(drain(stream.follow()))
        source.put("a")
        source.fail()
        return await follower

    events = asyncio.run(main())
    assert [event.split("\n", 1)[0] for event in events] == ["id: 0", "id: 1", "id: 2"]
    assert datas(events)[0] == "a" and json.loads(datas(events)[1])["error"]["code"] == "stream_failed" and events[2].endswith(SSE_DONE)


def test_another_owner_cannot_get_a_stream():
    async def main():
        registry = StreamRegistry()
        source = Source()
        registry.open("s1", "key-a", source.events())
        assert (await registry.get("s1", "key-a")).owner == "key-a"
        with pytest.raises(APIError) as refused:
            await registry.get("s1", "key-b")
        await registry.close()
        return refused.value, len(registry)

    refused, remaining = asyncio.run(main())
    assert refused.status == 404 and remaining == 0
