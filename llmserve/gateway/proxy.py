"""Forwarding one request to a replica of its pool, with one retry and streams relayed as they come.

A request that fails before any byte reached the client (the connection is refused or times out, the
replica answers 503, dies before its headers, or breaks off a non-streamed body, which is buffered) is
retried once on another replica, the failed one excluded; a replica that fails so is ejected at once.
A replica that answers the drain 503 (`shutting_down`: it got SIGTERM) is not failing: the pool marks
it draining and the request goes to another replica without spending its retry.
A stream is relayed event by event (only whole SSE events go out, so an error event can always follow);
its first event is read before the client gets the headers, so a replica that dies before its first
token is retried too. A stream broken after that ends with an error event in OpenAI's shape, then
`data: [DONE]`.

A hung replica (it accepts connections but never answers, or stalls mid-stream) holds nobody forever:
waiting for the first byte (a non-streamed reply's whole body, a stream's first event) ends after
`first_byte_timeout_s` or as soon as the health checks eject the replica, whichever comes first, and
the request is retried elsewhere; a stream that sends nothing for `stream_idle_timeout_s` ends with
an error event.

A caller may rewrite a stream's events on their way (a `StreamFilter`: the platform screens the output
and counts the usage there) and learns when the response is over, whether its body ran or not.

A chat or completion whose pool has prefill replicas may be disaggregated (disaggregation.py): once its
decode replica is chosen, the prefill call is made, and the decode replica (and a retry's) is sent the
request with the transfer's `kv_transfer_params`; the caller passes the parsed body (`payload`) for that."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
from fastapi.responses import Response, StreamingResponse

from llmserve.gateway import errors
from llmserve.gateway.client import REPLICA_ERRORS, ReplicaClient
from llmserve.gateway.metrics import GatewayMetrics
from llmserve.gateway.pool import Pool, is_draining_answer
from llmserve.gateway.prefix_index import PromptKey
from llmserve.gateway.replica import Replica, ReplicaState
from llmserve.gateway.routing import NoReplicaAvailable

if TYPE_CHECKING:
    from llmserve.gateway.disaggregation import Disaggregator

MAX_ATTEMPTS = 2  # the first try and one retry (a draining replica's refusal is not a try)
FIRST_BYTE_TIMEOUT_S = 600.0  # a non-streamed reply comes whole: this bounds a whole generation
STREAM_IDLE_TIMEOUT_S = 60.0
EVENT_END = b"\n\n"
# Not forwarded: they describe one hop's connection, or are set again by the next hop's server.
HOP_HEADERS = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length", "date", "server",
})


def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in headers.items() if name.lower() not in HOP_HEADERS}


def prompt_key(payload: dict) -> PromptKey:
    """What the prefix policy routes on: a chat's message texts joined (a conversation's next turn
    starts with the same text), a response's instructions and input texts, a completion's prompt, or an
    embeddings request's input. O(prompt) on
    the event loop, as is parsing the body; fine at a few hundred KB."""
    if "messages" in payload:
        return "\n".join(_message_text(message) for message in payload.get("messages") or ())
    items = payload.get("input")
    if isinstance(items, list) and items and isinstance(items[0], dict):  # the Responses API's input items
        return "\n".join([payload.get("instructions") or "", *(_message_text(item) for item in items)])
    prompt = payload.get("prompt", payload.get("input", ""))
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return prompt  # token ids
        return first if isinstance(first, str) else [t for t in first if isinstance(t, int)]
    return prompt if isinstance(prompt, str) else ""


def prompt_cache_key(payload: dict) -> str | None:
    """The request's `prompt_cache_key` (OpenAI's), when it is a non-empty string."""
    key = payload.get("prompt_cache_key")
    return key if isinstance(key, str) and key else None


def _message_text(message: object) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


class StreamFilter(Protocol):
    def events(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """The stream's whole SSE events as the client gets them; closing this iterator early closes
        the replica's response (which aborts the generation there)."""
        ...

    def ended(self) -> None:
        """The response is over, its body sent or not (the client may leave before it starts)."""
        ...


class _Failed(Exception):
    """This attempt failed before any byte reached the client; another replica may take the request."""


class _Draining(Exception):
    """The replica refused the request because it is draining; another replica takes it."""


class Proxy:
    def __init__(
        self, client: ReplicaClient, metrics: GatewayMetrics, *,
        first_byte_timeout_s: float = FIRST_BYTE_TIMEOUT_S, stream_idle_timeout_s: float = STREAM_IDLE_TIMEOUT_S,
        disaggregator: Disaggregator | None = None,
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.disaggregator = disaggregator
        self.first_byte_timeout_s = first_byte_timeout_s
        self.stream_idle_timeout_s = stream_idle_timeout_s

    async def forward(
        self, pool: Pool, path: str, body: bytes, prompt: PromptKey, headers: Mapping[str, str],
        stream_filter: Callable[[], StreamFilter] | None = None, cache_key: str | None = None, method: str = "POST",
        payload: Mapping[str, Any] | None = None,
    ) -> Response:
        """The replica's response; a stream's events go through the filter `stream_filter` makes (called
        once the stream is handed over to the client, so never for a request that failed before).
        `cache_key`: the request's `prompt_cache_key`, which routing takes with the prompt. `payload`: the
        body parsed (a chat's or completion's, to be disaggregated when its pool has prefill replicas)."""
        disaggregator = self.disaggregator
        undecided = disaggregator is not None and disaggregator.applies(pool, path, payload)
        tried: list[Replica] = []
        failures = 0
        reason = ""
        while failures < MAX_ATTEMPTS:
            try:
                route = pool.route(prompt, tried, cache_key)
            except NoReplicaAvailable:
                return errors.no_replica(pool.name)
            replica = route.replica
            if undecided:  # once: a retry's replica is sent the same body, the transfer still waiting
                assert disaggregator is not None and payload is not None
                undecided = False
                body = await disaggregator.decode_request(pool, path, payload, prompt, route, headers) or body
            if tried:
                self.metrics.retried.labels(pool.name).inc()
            try:
                return await self._send(pool, replica, method, path, body, headers, stream_filter)
            except _Draining:
                tried.append(replica)
            except _Failed as exc:
                tried.append(replica)
                failures += 1
                reason = str(exc)
        return errors.replica_failed(f"The request failed on {failures} replicas of `{pool.name}`: {reason}")

    async def _send(
        self, pool: Pool, replica: Replica, method: str, path: str, body: bytes, headers: Mapping[str, str],
        stream_filter: Callable[[], StreamFilter] | None,
    ) -> Response:
        pool.policy.on_start(replica)
        self.metrics.requests.labels(pool.name, replica.url).inc()
        response: aiohttp.ClientResponse | None = None
        handed_over = False  # once the relay owns the response, it closes it and finishes the request
        try:
            try:
                async with replica.waiting_for_answer(self.first_byte_timeout_s):
                    response = await self.client.session.request(method, replica.url + path, data=body,
                                                                 headers=headers)
                    if response.status == 503:
                        await self._refuse(pool, replica, response)
                    reply_headers = forwarded_headers(response.headers)
                    if not response.headers.get("content-type", "").startswith("text/event-stream"):
                        content = await self._read_all(pool, replica, response)
                        return Response(content, status_code=response.status, headers=reply_headers)
                    first, rest = await self._first_events(pool, replica, response.content)
            except TimeoutError as exc:  # before REPLICA_ERRORS, which holds OSError, its base
                lost = "was ejected" if replica.state is ReplicaState.EJECTED else "did not answer in time"
                raise self._fail(pool, replica, f"{lost} (waited for its first byte)") from exc
            except REPLICA_ERRORS as exc:
                raise self._fail(pool, replica, f"{type(exc).__name__}: {exc}") from exc
            handed_over = True
            rewrite = stream_filter() if stream_filter is not None else None
            finish = _Finish(pool, replica, response, rewrite.ended if rewrite is not None else None)
            events = self._relay(pool, replica, response.content, first, rest, finish)
            return _RelayResponse(
                rewrite.events(events) if rewrite is not None else events, finish,
                status_code=response.status, headers=reply_headers,
            )
        finally:
            if not handed_over:
                if response is not None:
                    response.release()
                pool.policy.on_finish(replica)

    async def _refuse(self, pool: Pool, replica: Replica, response: aiohttp.ClientResponse) -> None:
        """A 503: the replica is draining (another one takes the request), or failing (ejected)."""
        if is_draining_answer(503, await response.read()):
            pool.drain(replica)
            raise _Draining(replica.url)
        raise self._fail(pool, replica, "the replica answered 503")

    def _fail(self, pool: Pool, replica: Replica, reason: str) -> _Failed:
        pool.eject(replica, reason)
        return _Failed(f"{replica.url}: {reason}")

    async def _read_all(self, pool: Pool, replica: Replica, response: aiohttp.ClientResponse) -> bytes:
        try:
            return await response.read()
        except REPLICA_ERRORS as exc:
            raise self._fail(pool, replica, f"broke off mid-response: {type(exc).__name__}") from exc

    async def _first_events(
        self, pool: Pool, replica: Replica, content: aiohttp.StreamReader
    ) -> tuple[bytes, bytes]:
        """The stream's first whole events, and what came after them."""
        buffer = b""
        try:
            while chunk := await content.readany():
                buffer += chunk
                cut = buffer.rfind(EVENT_END)
                if cut >= 0:
                    return buffer[:cut + len(EVENT_END)], buffer[cut + len(EVENT_END):]
        except REPLICA_ERRORS as exc:
            raise self._fail(pool, replica, f"broke off before its first event: {type(exc).__name__}") from exc
        return buffer, b""  # the stream ended without a whole event: pass it on as it is

    async def _relay(
        self, pool: Pool, replica: Replica, content: aiohttp.StreamReader, first: bytes, pending: bytes,
        finish: _Finish,
    ) -> AsyncIterator[bytes]:
        try:
            yield first
            try:
                while True:
                    async with asyncio.timeout(self.stream_idle_timeout_s):  # around the read only
                        chunk = await content.readany()
                    if not chunk:
                        break
                    pending += chunk
                    cut = pending.rfind(EVENT_END)
                    if cut >= 0:
                        yield pending[:cut + len(EVENT_END)]
                        pending = pending[cut + len(EVENT_END):]
            except TimeoutError:  # stalled: the health checks decide whether the replica is hung
                self.metrics.streams_broken.labels(pool.name).inc()
                yield errors.sse_error_and_done(
                    f"The replica serving this stream sent nothing for {self.stream_idle_timeout_s:g} s.")
                return
            except REPLICA_ERRORS as exc:
                self.metrics.streams_broken.labels(pool.name).inc()
                pool.eject(replica, f"stream broke off: {type(exc).__name__}")
                yield errors.sse_error_and_done(f"The replica serving this stream failed ({type(exc).__name__}).")
                return
            if pending:
                yield pending
        finally:
            await finish()


class _Finish:
    """Closes a relayed stream's replica response and ends the request's in-flight count, once."""

    def __init__(
        self, pool: Pool, replica: Replica, response: aiohttp.ClientResponse,
        then: Callable[[], None] | None = None,
    ) -> None:
        self._pool, self._replica, self._response = pool, replica, response
        self._then = then
        self._done = False

    async def __call__(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._response.release()  # its connection is closed unless the body was read to its end
        finally:
            self._pool.policy.on_finish(self._replica)
            if self._then is not None:
                self._then()


class _RelayResponse(StreamingResponse):
    """A relayed stream that finishes its request even when the client left before the body started
    (its generator then never runs, so the generator's own `finally` would not either)."""

    def __init__(self, content: AsyncIterator[bytes], finish: _Finish, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._finish = finish

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._finish()
