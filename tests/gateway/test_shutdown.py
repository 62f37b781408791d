"""The gateway's cut-off at the end of its shutdown timeout: a relayed stream, waiting for its replica
or between events, ends with a `shutting_down` error event numbered after what it sent, and the
stream it relayed is closed (so its relay meters it and its replica's response is closed)."""

from __future__ import annotations

import asyncio
import json

from llmserve.gateway.shutdown import StreamCutoff


def test_a_stream_waiting_for_its_replica_ends_at_the_cut_off_with_an_error_event() -> None:
    closed = []

    async def replica_stream():
        try:
            yield b"id: 0\ndata: {}\n\nid: 1\ndata: {}\n\n"
            await asyncio.Event().wait()  # a replica that sends nothing more
        finally:
            closed.append(True)

    async def scenario() -> list[bytes]:
        cutoff = StreamCutoff()
        received: list[bytes] = []

        async def client() -> None:
            async for chunk in cutoff.guard(replica_stream()):
                received.append(chunk)
                if len(received) == 1:
                    asyncio.get_running_loop().call_soon(cutoff.cut_all)

        await asyncio.wait_for(client(), timeout=10)
        return received

    first, end = asyncio.run(scenario())
    assert first == b"id: 0\ndata: {}\n\nid: 1\ndata: {}\n\n"
    error, done = end.decode().split("\n\n")[:2]
    assert error.startswith("id: 2\ndata: ") and done == "id: 3\ndata: [DONE]"
    assert json.loads(error.split("data: ", 1)[1])["error"]["code"] == "shutting_down"
    assert closed == [True]


def test_a_stream_that_starts_after_the_cut_off_ends_at_once() -> None:
    async def replica_stream():
        yield b"id: 0\ndata: {}\n\n"

    async def scenario() -> list[bytes]:
        cutoff = StreamCutoff()
        cutoff.cut_all()
        return [chunk async for chunk in cutoff.guard(replica_stream())]

    [end] = asyncio.run(scenario())
    assert end.startswith(b"id: 0\ndata: {\"error\"") and end.endswith(b"id: 1\ndata: [DONE]\n\n")
