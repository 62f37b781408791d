"""A streaming OpenAI-compatible client that times every chunk of one request.

It speaks both /v1/completions (`choices[].text`) and /v1/chat/completions
(`choices[].delta.content`), reads the usage chunk that `stream_options.include_usage` asks for,
and turns every failure (HTTP status, broken connection, error event, timeout) into a failed
`RequestResult` instead of an exception.

The streaming path is a small HTTP/1.1 client on an asyncio protocol rather than a general HTTP
library: a fast server streams one SSE event per token, and the benchmark client shares the machine
with it, so the client's cost per event decides whether it measures the server or itself. Each
socket read is de-chunked and split into `data:` lines inside `data_received`, which records only
the raw payload and the read's timestamp; the payloads are JSON-decoded once, in one call, when the
stream has ended. On a 2-core machine with 256-512 streams, httpx (anyio and h11 underneath) took
40-80 us of user CPU per event, aiohttp 25-30 us, this 5-10 us (plus ~5 us of kernel time per read).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from llmserve.bench.metrics import RequestResult

if TYPE_CHECKING:
    import httpx

DEFAULT_TIMEOUT_S = 6 * 3600.0  # per request, start to end (as vLLM's benchmark_serving)
ERROR_BODY_CHARS = 300
MAX_HEAD_BYTES = 64 * 1024  # a response head (status line and headers) larger than this is an error
MAX_ERROR_BODY_BYTES = 64 * 1024  # of a non-200 body, what is read before the connection is dropped
MAX_CHUNK_LINE_BYTES = 1024
READ_BUFFER_BYTES = 256 * 1024


def is_chat_endpoint(endpoint: str) -> bool:
    return "chat" in endpoint


def join_url(base_url: str, endpoint: str) -> str:
    """base_url + endpoint, tolerating a base URL that already ends in /v1."""
    base = base_url.rstrip("/")
    path = endpoint if endpoint.startswith("/") else f"/{endpoint}"
    if base.endswith("/v1") and path.startswith("/v1/"):
        base = base[: -len("/v1")]
    return base + path


def server_root(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def discover_model(client: httpx.Client, base_url: str) -> str:
    """The first model id the server lists at GET /v1/models."""
    response = client.get(join_url(base_url, "/v1/models"))
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url} lists no models; pass --model")
    return str(models[0]["id"])


@dataclass
class SamplingOptions:
    """Per-request body fields shared by every request of a run."""

    temperature: float = 0.0
    exact_output_len: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)


def build_payload(
    model: str,
    endpoint: str,
    prompt: str | list[int] | list[dict[str, str]],
    max_tokens: int,
    options: SamplingOptions,
) -> dict[str, Any]:
    """A streaming request body; `prompt` is the messages list for chat endpoints."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": options.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    body["messages" if is_chat_endpoint(endpoint) else "prompt"] = prompt
    if options.exact_output_len:
        body["min_tokens"] = max_tokens
    body.update(options.extra_body)
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    """Generated text in one stream chunk (completion text, chat content or reasoning content)."""
    choices = chunk.get("choices")
    if not choices or not isinstance(choices, list):
        return ""
    pieces: list[str] = []
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        text = choice.get("text")
        if isinstance(text, str):
            pieces.append(text)
        delta = choice.get("delta")
        if isinstance(delta, dict):
            for key in ("reasoning_content", "reasoning", "content"):
                value = delta.get(key)
                if isinstance(value, str):
                    pieces.append(value)
    return pieces[0] if len(pieces) == 1 else "".join(pieces)


def _error_text(error: Any) -> str:
    return json.dumps(error)[:ERROR_BODY_CHARS]


def _stream_error(payload: bytes) -> str | None:
    """The error of an `{"error": ...}` event, else None (also for payloads that are not JSON)."""
    try:
        chunk = json.loads(payload)
    except ValueError:
        return None
    if isinstance(chunk, dict) and chunk.get("error"):
        return _error_text(chunk["error"])
    return None


# ---------------------------------------------------------------------------------------------
# one request
# ---------------------------------------------------------------------------------------------

_RETRY = "retry"  # the future's result when a reused keep-alive connection closed before answering


class _Exchange:
    """One request's response as it arrives: status, raw `data:` payloads with their arrival times."""

    __slots__ = ("start", "end", "status", "error", "payloads", "times", "error_body", "future")

    def __init__(self, start: float) -> None:
        self.start = start
        self.end: float | None = None
        self.status: int | None = None
        self.error: str | None = None
        self.payloads: list[bytes] = []
        self.times: list[float] = []
        self.error_body: list[bytes] = []
        self.future: asyncio.Future[str | None] | None = None

    @property
    def settled(self) -> bool:
        return self.end is not None

    def settle(self, error: str | None = None) -> None:
        """The response is over (complete, or failed with `error`); wakes the waiting request."""
        if self.end is not None:
            return
        self.end = time.perf_counter()
        self.error = error
        if self.future is not None and not self.future.done():
            self.future.set_result(None)

    def settle_http_error(self) -> None:
        body = b"".join(self.error_body).decode("utf-8", "replace")
        self.settle(f"HTTP {self.status}: {body[:ERROR_BODY_CHARS]}")

    def result(self, count_tokens: Callable[[str], int] | None) -> RequestResult:
        """The measured result; the payloads are decoded here, once, in one json.loads call."""
        result = RequestResult(status=self.status)
        end = self.end if self.end is not None else time.perf_counter()
        result.latency = end - self.start
        error = self.error
        chunks: list[Any] = []
        if self.payloads:
            try:
                chunks = json.loads(b"[" + b",".join(self.payloads) + b"]")
            except ValueError:
                chunks = []
            if len(chunks) != len(self.payloads):  # some payload is not one JSON value: find which
                chunks, decode_error = _decode_each(self.payloads)
                error = error or decode_error
        pieces: list[str] = []
        itl = result.itl
        last: float | None = None
        usage: dict[str, Any] | None = None
        for chunk, now in zip(chunks, self.times, strict=False):
            if not isinstance(chunk, dict):
                error = error or f"ValueError: unexpected stream event {json.dumps(chunk)[:100]}"
                break
            if chunk.get("error"):
                error = error or f"StreamError: {_error_text(chunk['error'])}"
                break
            chunk_usage = chunk.get("usage")
            if isinstance(chunk_usage, dict):
                usage = chunk_usage
            text = _chunk_text(chunk)
            if not text:
                continue
            if last is None:
                result.ttft = now - self.start
            else:
                itl.append(now - last)
            last = now
            pieces.append(text)
        result.generated_text = "".join(pieces)
        if error is not None:
            result.error = error
            return result
        usage = usage or {}
        if usage.get("completion_tokens") is not None:
            result.output_tokens = int(usage["completion_tokens"])
        elif count_tokens is not None:
            result.output_tokens = count_tokens(result.generated_text)
        else:
            result.output_tokens = len(pieces)
        if usage.get("prompt_tokens") is not None:
            result.input_tokens = int(usage["prompt_tokens"])
        if result.ttft is None and result.output_tokens > 0:
            result.ttft = result.latency  # only empty-text tokens (e.g. skipped special tokens) came back
        result.success = result.output_tokens > 0
        if not result.success:
            result.error = "EmptyResponse: the stream carried no generated tokens"
        return result


def _decode_each(payloads: list[bytes]) -> tuple[list[Any], str]:
    """The events before the first undecodable one, and that one's error."""
    chunks = []
    for payload in payloads:
        try:
            chunks.append(json.loads(payload))
        except ValueError as exc:
            return chunks, f"{type(exc).__name__}: {exc}"
    return chunks, "ValueError: a stream event holds more than one JSON value"


# ---------------------------------------------------------------------------------------------
# HTTP/1.1 on an asyncio protocol
# ---------------------------------------------------------------------------------------------

_IDLE, _HEAD, _CHUNKED, _LENGTH, _UNTIL_CLOSE, _TRAILER = range(6)


class _ProtocolError(Exception):
    """The server's bytes are not a valid HTTP/1.1 response."""


@dataclass(frozen=True)
class _Target:
    key: tuple[str, str, int]  # scheme, host, port: what a keep-alive connection can be reused for
    host: str
    port: int
    https: bool
    head: bytes  # the request line and the headers that every request to this URL carries

    @classmethod
    def parse(cls, url: str) -> _Target:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        https = parts.scheme == "https"
        port = parts.port or (443 if https else 80)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host_header = parts.netloc.rpartition("@")[2]
        head = (f"POST {path} HTTP/1.1\r\nHost: {host_header}\r\nUser-Agent: llmserve-bench\r\n"
                "Accept: text/event-stream\r\nContent-Type: application/json\r\n")
        return cls((parts.scheme, parts.hostname, port), parts.hostname, port, https, head.encode("ascii"))


class _Connection(asyncio.BufferedProtocol):
    """One keep-alive connection. While a response streams, each read is de-chunked and split into
    SSE lines right here; a `data:` line's payload is kept as bytes with the read's timestamp.

    Reads land in one buffer shared by all connections (a plain Protocol would have asyncio
    allocate a fresh 256 KiB bytes per read: an mmap, mremap and munmap each time).
    """

    def __init__(self, pool: StreamClient, key: tuple[str, str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.exchange: _Exchange | None = None
        self.state = _IDLE
        self.buf = b""  # unparsed bytes: an incomplete head or chunk-size line
        self.tail = b""  # an incomplete SSE line
        self.chunk_left = 0  # data bytes of the current chunk still to come
        self.skip = 0  # bytes of the CRLF after a chunk's data still to skip
        self.body_left = 0  # Content-Length bytes still to come
        self.sse = False  # a 200 response: its body is an event stream
        self.keep_alive = True
        self.received = False  # any byte of the current response came
        self.reused = False
        self.closed = False

    # -- asyncio callbacks --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.pool._read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self.pool._read_buffer[:nbytes].tobytes())

    def data_received(self, data: bytes) -> None:
        self.received = True
        if self.buf:
            data = self.buf + data
            self.buf = b""
        try:
            state = self.state
            if state == _HEAD:
                data = self._head(data)
                state = self.state
                if not data and state != _LENGTH:
                    return
            if state == _CHUNKED:
                self._chunked(data)
            elif state == _UNTIL_CLOSE:
                self._body(data)
            elif state == _LENGTH:
                self._sized(data)
            elif state == _TRAILER:
                self._trailer(data)
            elif data:
                raise _ProtocolError("bytes arrived outside a response")
        except (_ProtocolError, ValueError) as exc:
            self._fail(f"RemoteProtocolError: {exc}")

    def eof_received(self) -> bool:
        return False  # close; connection_lost settles whatever is still open

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool._forget(self)
        ex = self.exchange
        self.exchange = None
        if ex is None or ex.settled:
            return
        if self.state == _UNTIL_CLOSE:  # the body was delimited by the close: it is complete
            self.state = _IDLE
            self._finish_events(ex)
            self._settle(ex)
        elif self.state == _HEAD and not self.received and self.reused:
            # The server dropped this idle keep-alive connection as the request went out: resend.
            if ex.future is not None and not ex.future.done():
                ex.future.set_result(_RETRY)
        elif exc is not None:
            ex.settle(f"ReadError: {type(exc).__name__}: {exc}")
        else:
            what = "before the response head" if self.state == _HEAD else "mid-response"
            ex.settle(f"RemoteProtocolError: the server closed the connection {what}")

    # -- requests -----------------------------------------------------------------------------

    def send(self, exchange: _Exchange, request: bytes) -> None:
        self.exchange = exchange
        self.state = _HEAD
        self.received = False
        self.buf = self.tail = b""
        self.chunk_left = self.skip = self.body_left = 0
        assert self.transport is not None
        self.transport.write(request)

    def abort(self) -> None:
        self.exchange = None
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    @property
    def reusable(self) -> bool:
        return self.state == _IDLE and not self.closed and self.transport is not None \
            and not self.transport.is_closing()

    # -- parsing ------------------------------------------------------------------------------

    def _head(self, data: bytes) -> bytes:
        """Parse the status line and headers; returns the body bytes after them."""
        while True:
            end = data.find(b"\r\n\r\n")
            if end < 0:
                if len(data) > MAX_HEAD_BYTES:
                    raise _ProtocolError("response head too large")
                self.buf = data
                return b""
            lines = data[:end].decode("latin-1").split("\r\n")
            data = data[end + 4:]
            version, _, rest = lines[0].partition(" ")
            if not version.startswith("HTTP/1."):
                raise _ProtocolError(f"bad status line {lines[0][:100]!r}")
            status = int(rest[:3])
            if 100 <= status < 200:
                continue  # an interim response (100 Continue): the real head follows
            headers: dict[str, str] = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            break
        connection = headers.get("connection", "").lower()
        self.keep_alive = version == "HTTP/1.1" and "close" not in connection
        ex = self.exchange
        if ex is not None:
            ex.status = status
        self.sse = status == 200
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self.state = _CHUNKED
        elif "content-length" in headers:
            self.state = _LENGTH
            self.body_left = int(headers["content-length"])
        elif status in (204, 304):
            self.state = _LENGTH
            self.body_left = 0
        else:
            self.state = _UNTIL_CLOSE
            self.keep_alive = False
        return data

    def _chunked(self, data: bytes) -> None:
        """De-chunk one read and hand its body bytes on, in one piece."""
        pos = 0
        end = len(data)
        pieces: list[bytes] = []
        while pos < end:
            left = self.chunk_left
            if left:
                stop = pos + left
                if stop > end:
                    pieces.append(data[pos:] if pos else data)
                    self.chunk_left = stop - end
                    break
                pieces.append(data[pos:stop])
                pos = stop
                self.chunk_left = 0
                self.skip = 2
            if self.skip:
                take = min(self.skip, end - pos)
                pos += take
                self.skip -= take
                continue
            eol = data.find(b"\r\n", pos)
            if eol < 0:
                if end - pos > MAX_CHUNK_LINE_BYTES:
                    raise _ProtocolError("chunk-size line too long")
                self.buf = data[pos:]
                break
            size = int(data[pos:eol].split(b";", 1)[0], 16)
            pos = eol + 2
            if size == 0:
                if pieces:
                    self._body(pieces[0] if len(pieces) == 1 else b"".join(pieces))
                self.state = _TRAILER
                self._trailer(data[pos:])
                return
            self.chunk_left = size
        if pieces:
            self._body(pieces[0] if len(pieces) == 1 else b"".join(pieces))

    def _trailer(self, data: bytes) -> None:
        if data.startswith(b"\r\n"):
            rest = data[2:]
        else:
            end = data.find(b"\r\n\r\n")
            if end < 0:
                if len(data) > MAX_HEAD_BYTES:
                    raise _ProtocolError("trailer too large")
                self.buf = data
                return
            rest = data[end + 4:]
        self._complete(rest)

    def _sized(self, data: bytes) -> None:
        if len(data) >= self.body_left:
            body, rest = data[:self.body_left], data[self.body_left:]
            self.body_left = 0
            if body:
                self._body(body)
            self._complete(rest)
        else:
            self.body_left -= len(data)
            self._body(data)

    def _body(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None or ex.end is not None:
            return  # the request is over already ([DONE]); the rest of the body is drained
        if not self.sse:
            ex.error_body.append(data)
            if sum(map(len, ex.error_body)) > MAX_ERROR_BODY_BYTES:
                ex.settle_http_error()
                self.abort()
            return
        if self.tail:
            data = self.tail + data
        if b"\r" in data:  # CRLF or CR line ends; a CR split from its LF only adds an empty line
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = data.split(b"\n")
        self.tail = lines.pop()
        self._events(ex, lines, time.perf_counter())

    def _events(self, ex: _Exchange, lines: list[bytes], now: float) -> None:
        payloads = ex.payloads
        times = ex.times
        for line in lines:
            if not line.startswith(b"data:"):
                continue  # blank separators, comments (": ping"), event names
            payload = line[5:].strip()
            if payload == b"[DONE]":
                ex.settle()
                return
            if not payload:
                continue
            if b'"error"' in payload:  # a key "error" (a quote inside a JSON string is escaped)
                error = _stream_error(payload)
                if error is not None:
                    ex.settle(f"StreamError: {error}")
                    self.abort()
                    return
            payloads.append(payload)
            times.append(now)

    def _finish_events(self, ex: _Exchange) -> None:
        """At the body's end: the last line may lack its newline."""
        if self.sse and self.tail and ex.end is None:
            tail, self.tail = self.tail, b""
            self._events(ex, [tail.strip()], time.perf_counter())

    def _complete(self, rest: bytes) -> None:
        """The response body has ended; `rest` is whatever came after it."""
        self.state = _IDLE
        ex = self.exchange
        self.exchange = None
        if ex is not None and ex.end is None:
            self._finish_events(ex)
            self._settle(ex)
        if rest or not self.keep_alive or self.closed:
            self.abort()
        else:
            self.pool._release(self)

    def _settle(self, ex: _Exchange) -> None:
        if self.sse:
            ex.settle()
        else:
            ex.settle_http_error()

    def _fail(self, error: str) -> None:
        ex = self.exchange
        if ex is not None:
            ex.settle(error)
        self.abort()


class StreamClient:
    """Keep-alive HTTP/1.1 connections shared by a run's streaming requests (an async context manager).

    `timeout` bounds each request from its start (connecting included) to its last byte.
    """

    def __init__(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout = timeout
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._targets: dict[str, _Target] = {}
        self._ssl: Any = None
        # Every read goes here and is copied out at once (reads never interleave), so one will do.
        self._read_buffer = memoryview(bytearray(READ_BUFFER_BYTES))

    async def __aenter__(self) -> StreamClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for conn in list(self._open):
            if conn.transport is not None:
                conn.transport.close()
        self._open.clear()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports close their sockets

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = _Target.parse(url)
        return target

    def _release(self, conn: _Connection) -> None:
        self._idle.setdefault(conn.key, []).append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)

    async def _connect(self, target: _Target) -> _Connection:
        loop = asyncio.get_running_loop()
        ssl_context = None
        if target.https:
            if self._ssl is None:
                import ssl

                self._ssl = ssl.create_default_context()
            ssl_context = self._ssl
        _, conn = await loop.create_connection(
            lambda: _Connection(self, target.key), target.host, target.port, ssl=ssl_context,
        )
        self._open.add(conn)
        return conn

    async def _exchange(self, url: str, payload: dict[str, Any], ex: _Exchange) -> None:
        target = self._target(url)
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
        request = b"%sContent-Length: %d\r\n\r\n%s" % (target.head, len(body), body)
        loop = asyncio.get_running_loop()
        idle = self._idle.get(target.key)
        while True:
            conn = None
            while idle:
                candidate = idle.pop()
                if candidate.reusable:
                    conn = candidate
                    break
            conn_reused = conn is not None
            if conn is None:
                try:
                    conn = await self._connect(target)
                except OSError as exc:
                    ex.settle(f"ConnectError: {type(exc).__name__}: {exc}")
                    return
            conn.reused = conn_reused
            ex.future = loop.create_future()
            conn.send(ex, request)
            try:
                outcome = await ex.future
            finally:
                if not ex.settled and conn.exchange is ex:
                    conn.abort()  # timed out or cancelled mid-response: the connection is unusable
            if outcome != _RETRY:
                return
            idle = None  # retry once, on a new connection


async def stream_request(
    client: StreamClient,
    url: str,
    payload: dict[str, Any],
    count_tokens: Callable[[str], int] | None = None,
) -> RequestResult:
    """Send one streaming request and measure it; never raises for server or network failures."""
    ex = _Exchange(time.perf_counter())
    try:
        await asyncio.wait_for(client._exchange(url, payload, ex), client.timeout)
    except asyncio.TimeoutError:
        ex.settle(f"TimeoutError: no complete response within {client.timeout:g} s")
    except ValueError as exc:  # a malformed URL or a body json.dumps cannot encode
        ex.settle(f"{type(exc).__name__}: {exc}")
    return ex.result(count_tokens)
