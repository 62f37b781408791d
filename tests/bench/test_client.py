"""The benchmark's streaming HTTP client: response parsing and failure handling, against raw byte servers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from llmserve.bench import datasets
from llmserve.bench.client import (
    StreamClient,
    _Connection,
    _Exchange,
    join_url,
    stream_request,
)
from llmserve.bench.serve import BenchConfig, run_once

# ---------------------------------------------------------------------------------------------
# helpers: SSE bytes and a raw HTTP server whose every byte the test scripts
# ---------------------------------------------------------------------------------------------

CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
PAYLOAD = {"model": "m", "prompt": "hi", "max_tokens": 3, "stream": True}


def event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def text(piece: str) -> bytes:
    return event({"id": "x", "choices": [{"index": 0, "text": piece, "finish_reason": None}]})


def usage(prompt: int, completion: int) -> bytes:
    return event({"id": "x", "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}})


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def chunked(*events: bytes) -> bytes:
    return CHUNKED_HEAD + b"".join(chunk(e) for e in events) + b"0\r\n\r\n"


Respond = Callable[[asyncio.StreamWriter, str, dict[str, Any], int], Awaitable[bool]]


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, dict[str, Any]] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.decode("latin-1").split("\r\n")
    length = next(int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:"))
    return lines[0].split(" ")[1], json.loads(await reader.readexactly(length))


@contextlib.asynccontextmanager
async def raw_server(respond: Respond) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """Calls respond(writer, path, body, request_number) for each request; it returns False to hang up."""
    stats: dict[str, Any] = {"connections": 0, "requests": []}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stats["connections"] += 1
        try:
            while (request := await _read_request(reader)) is not None:
                stats["requests"].append(request)
                if not await respond(writer, *request, len(stats["requests"])):
                    break
                await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", stats
    finally:
        server.close()


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))  # type: ignore[arg-type]


async def request_once(respond: Respond, path: str = "/v1/completions", timeout: float = 10.0,
                       payload: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any], float]:
    async with raw_server(respond) as (url, stats), StreamClient(timeout=timeout) as client:
        start = time.perf_counter()
        result = await stream_request(client, url + path, payload or PAYLOAD)
        return result, stats, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# the parser, fed bytes directly
# ---------------------------------------------------------------------------------------------


class _Pool:
    """Stands in for StreamClient: the shared read buffer and the idle list."""

    def __init__(self) -> None:
        self._read_buffer = memoryview(bytearray(4096))
        self.released: list[_Connection] = []

    def _release(self, conn: _Connection) -> None:
        self.released.append(conn)

    def _forget(self, conn: _Connection) -> None:
        pass


class _Transport:
    def __init__(self) -> None:
        self.aborted = False

    def write(self, data: bytes) -> None:
        pass

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted


def feed(pieces: list[bytes]) -> tuple[_Exchange, _Pool, _Transport]:
    pool, transport = _Pool(), _Transport()
    conn = _Connection(pool, ("http", "h", 1))  # type: ignore[arg-type]
    conn.connection_made(transport)  # type: ignore[arg-type]
    exchange = _Exchange(time.perf_counter())
    conn.send(exchange, b"")
    for piece in pieces:
        buffer = conn.get_buffer(-1)
        buffer[: len(piece)] = piece
        conn.buffer_updated(len(piece))
    return exchange, pool, transport


# A response with what a stream may carry besides plain events: a chunk extension, a comment, an
# event-name line, CRLF line ends, an event split over two chunks, two events in one chunk, a
# role-only chat chunk, a usage chunk and a trailer after the last chunk.
TRICKY_EVENTS = [
    event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}),
    b": ping\n\n",
    b"event: message\r\ndata: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "Hel"}}]}).encode()
    + b"\r\n\r\n",
    text("lo")[:9],
    text("lo")[9:] + text(", w"),
    event({"choices": [{"index": 0, "text": "orld", "delta": {"reasoning_content": "!"}}]}),
    usage(4, 5),
    b"data: [DONE]\n\n",
]
TRICKY = (CHUNKED_HEAD + b"1b;name=value\r\n" + TRICKY_EVENTS[0][:27] + b"\r\n"
          + chunk(TRICKY_EVENTS[0][27:]) + b"".join(chunk(e) for e in TRICKY_EVENTS[1:])
          + b"0\r\nx-trailer: 1\r\n\r\n")


def test_a_stream_split_at_any_byte_boundary_parses_the_same() -> None:
    whole, pool, transport = feed([TRICKY])
    assert whole.settled and whole.error is None and whole.status == 200
    assert len(whole.payloads) == 6  # role chunk, 3 text chunks, reasoning chunk, usage
    assert pool.released and not transport.aborted  # the body ended cleanly: the connection is reusable
    result = whole.result(None)
    assert result.success and result.generated_text == "Hello, world!"
    assert (result.output_tokens, result.input_tokens, len(result.itl)) == (5, 4, 3)

    splits = [[TRICKY[:i], TRICKY[i:]] for i in range(1, len(TRICKY))]
    splits.append([TRICKY[i:i + 1] for i in range(len(TRICKY))])
    splits.append([TRICKY[i:i + 7] for i in range(0, len(TRICKY), 7)])
    for pieces in splits:
        exchange, pool, transport = feed(pieces)
        assert exchange.payloads == whole.payloads, [len(p) for p in pieces]
        assert exchange.settled and exchange.error is None
        assert pool.released and not transport.aborted
        assert exchange.result(None).generated_text == "Hello, world!"


def test_every_read_is_timed_and_empty_text_chunks_are_not_tokens() -> None:
    reads = [CHUNKED_HEAD + chunk(text("")), chunk(text("a")), chunk(text("b") + text("c")),
             chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"]
    exchange, pool, _ = feed(reads)
    result = exchange.result(None)
    assert result.success and pool.released
    assert result.generated_text == "abc" and result.output_tokens == 3  # no usage chunk: one per text chunk
    assert len(exchange.times) == 4 and len(result.itl) == 2
    assert result.itl[1] == 0.0  # "b" and "c" came in one read
    assert result.ttft == exchange.times[1] - exchange.start  # the first chunk with text, not the first chunk

    only_empty, _, _ = feed([chunked(text(""), b"data: [DONE]\n\n")])
    assert only_empty.result(None).error.startswith("EmptyResponse")


def test_malformed_responses_fail_instead_of_raising() -> None:
    for raw, error in [
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "RemoteProtocolError"),
        (b"SPDY 200\r\n\r\n", "RemoteProtocolError"),
        (chunked(b"data: {not json\n\n", b"data: [DONE]\n\n"), "JSONDecodeError"),
        (chunked(b"data: [1, 2]\n\n", b"data: [DONE]\n\n"), "ValueError"),
    ]:
        exchange, _, _ = feed([raw])
        result = exchange.result(None)
        assert not result.success and result.error.startswith(error), (raw, result.error)


# ---------------------------------------------------------------------------------------------
# against a server on a socket
# ---------------------------------------------------------------------------------------------


def test_an_error_event_inside_a_200_stream_fails_the_request_at_once() -> None:
    async def respond(writer: asyncio.StreamWriter, path: str, body: dict[str, Any], n: int) -> bool:
        writer.write(CHUNKED_HEAD + chunk(text("one ")) + chunk(text('say "error"')))
        writer.write(chunk(event({"error": {"message": "boom", "code": 500}})))
        await asyncio.sleep(20)  # the connection stays open: the client must not wait for it
        return False

    result, _, elapsed = run(request_once(respond))
    assert not result.success and result.status == 200
    assert result.error.startswith("StreamError:") and "boom" in result.error
    assert result.generated_text == 'one say "error"'  # a quoted "error" inside text is no error event
    assert elapsed < 5


def test_http_error_status_then_the_connection_is_reused() -> None:
    async def respond(writer: asyncio.StreamWriter, path: str, body: dict[str, Any], n: int) -> bool:
        if n == 1:
            data = json.dumps({"error": {"message": "server busy"}}).encode()
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(data), data))
        else:
            writer.write(chunked(text("ok"), usage(2, 1), b"data: [DONE]\n\n"))
        return True

    async def main() -> tuple[Any, Any, dict[str, Any]]:
        async with raw_server(respond) as (url, stats), StreamClient() as client:
            first = await stream_request(client, url + "/v1/completions", PAYLOAD)
            second = await stream_request(client, url + "/v1/completions", PAYLOAD)
            return first, second, stats

    first, second, stats = run(main())
    assert not first.success and first.status == 503
    assert first.error.startswith("HTTP 503: ") and "server busy" in first.error
    assert second.success and second.generated_text == "ok" and second.output_tokens == 1
    assert stats["connections"] == 1


def test_a_connection_dropped_mid_stream_fails_the_request() -> None:
    async def respond(writer: asyncio.StreamWriter, path: str, body: dict[str, Any], n: int) -> bool:
        writer.write(CHUNKED_HEAD + chunk(text("partial")) + b"40\r\ndata: {")
        return False

    result, _, _ = run(request_once(respond))
    assert not result.success and result.error.startswith("RemoteProtocolError")
    assert result.generated_text == "partial" and result.ttft is not None


def test_the_per_request_timeout_covers_the_whole_stream() -> None:
    async def respond(writer: asyncio.StreamWriter, path: str, body: dict[str, Any], n: int) -> bool:
        for i in range(100):
            writer.write((CHUNKED_HEAD if i == 0 else b"") + chunk(text(f"t{i} ")))
            await asyncio.sleep(0.05)  # every read comes well within the timeout; the whole stream does not
        return False

    result, _, elapsed = run(request_once(respond, timeout=0.5))
    assert not result.success and result.error.startswith("TimeoutError")
    assert 0.4 < elapsed < 3 and result.generated_text.startswith("t0 t1 ")


def test_a_refused_connection_fails_the_request() -> None:
    async def main() -> Any:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        async with StreamClient() as client:
            return await stream_request(client, f"http://127.0.0.1:{port}/v1/completions", PAYLOAD)

    result = run(main())
    assert not result.success and result.status is None and result.error.startswith("ConnectError")


@pytest.mark.parametrize("framing", ["content-length", "close"])
def test_unchunked_bodies(framing: str) -> None:
    body = text("a") + b": comment\r\n" + text("b").replace(b"\n", b"\r\n") + usage(1, 2) + b"data: [DONE]"

    async def respond(writer: asyncio.StreamWriter, path: str, _: dict[str, Any], n: int) -> bool:
        if framing == "content-length":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        else:
            writer.write(b"HTTP/1.0 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + body)
        return framing != "close"

    result, _, _ = run(request_once(respond))
    assert result.success and result.generated_text == "ab" and result.output_tokens == 2


def test_a_stale_keep_alive_connection_is_retried_once_on_a_new_one() -> None:
    async def respond(writer: asyncio.StreamWriter, path: str, body: dict[str, Any], n: int) -> bool:
        if n == 2:
            return False  # the server had dropped the idle connection: no response byte
        writer.write(chunked(text(f"r{n}"), b"data: [DONE]\n\n"))
        return True

    async def main() -> tuple[list[Any], dict[str, Any]]:
        async with raw_server(respond) as (url, stats), StreamClient() as client:
            results = [await stream_request(client, url + "/v1/completions", PAYLOAD) for _ in range(2)]
            return results, stats

    results, stats = run(main())
    assert [r.generated_text for r in results] == ["r1", "r3"]
    assert all(r.success for r in results) and stats["connections"] == 2


def test_a_fresh_connection_closed_without_an_answer_is_not_retried() -> None:
    async def respond(writer: asyncio.StreamWriter, path: str, body: dict[str, Any], n: int) -> bool:
        return False

    result, stats, _ = run(request_once(respond))
    assert not result.success and result.error.startswith("RemoteProtocolError")
    assert len(stats["requests"]) == 1


def test_chat_stream_with_v1_base_url_usage_and_ttft_after_empty_chunks() -> None:
    delta = lambda d: event({"choices": [{"index": 0, "delta": d, "finish_reason": None}]})  # noqa: E731

    async def respond(writer: asyncio.StreamWriter, path: str, body: dict[str, Any], n: int) -> bool:
        writer.write(CHUNKED_HEAD + chunk(delta({"role": "assistant", "content": ""})))
        await writer.drain()
        await asyncio.sleep(0.2)
        for piece in ("a", "b", "c"):
            writer.write(chunk(delta({"content": piece})))
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.write(chunk(delta({})) + chunk(usage(11, 5)) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        return True

    async def main() -> tuple[Any, dict[str, Any]]:
        async with raw_server(respond) as (url, stats), StreamClient() as client:
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            result = await stream_request(client, join_url(url + "/v1/", "/v1/chat/completions"), chat)
            return result, stats

    result, stats = run(main())
    assert stats["requests"][0][0] == "/v1/chat/completions"
    assert stats["requests"][0][1]["messages"] == [{"role": "user", "content": "hi"}]
    assert result.success and result.generated_text == "abc"
    assert (result.output_tokens, result.input_tokens) == (5, 11)  # the usage chunk wins over counting
    assert result.ttft >= 0.2 and len(result.itl) == 2 and all(gap > 0 for gap in result.itl)
    assert result.latency >= result.ttft


def test_max_concurrency_bounds_requests_in_flight() -> None:
    in_flight = {"now": 0, "max": 0}

    async def respond(writer: asyncio.StreamWriter, path: str, body: dict[str, Any], n: int) -> bool:
        in_flight["now"] += 1
        in_flight["max"] = max(in_flight["max"], in_flight["now"])
        writer.write(CHUNKED_HEAD + chunk(text("x")))
        await asyncio.sleep(0.05)
        in_flight["now"] -= 1
        writer.write(chunk(text("y")) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        return True

    async def main() -> tuple[list[Any], dict[str, Any]]:
        async with raw_server(respond) as (url, stats):
            config = BenchConfig(base_url=url + "/v1", endpoint="/v1/completions", model="m", dataset="random",
                                 num_prompts=9, rates=[float("inf")], max_concurrency=3, progress=False)
            conversations = [datasets.Conversation([datasets.Turn(f"q{i}", 1, 2)]) for i in range(9)]
            results, _ = await run_once(config, conversations, float("inf"), 0, None)
            return results, stats

    results, stats = run(main())
    assert all(r.success and r.generated_text == "xy" for r in results)
    assert in_flight["max"] == 3
    assert stats["connections"] == 3  # connections are kept alive and reused
