"""Resumable streams shared through Redis (server/streams.py). With `--redis-url`, a process producing a resumable
stream (a chat or completion asked with `stream_options.resumable`, a streamed background response) copies its
events into Redis as they come, so that any process sharing that Redis (gateways side by side behind a load
balancer, `llmserve serve` replicas of one platform) can serve a resume of it (`GET /v1/streams/{id}`,
`GET /v1/responses/{id}?stream=true`) and stop it (`DELETE /v1/streams/{id}`); a client following it from another
process keeps it alive past the grace period, as a follower in the producer's own process does.

The stream `S` lives in three keys, all gone with the stream:
- `<prefix>S`, a hash: `owner` (the key id that may follow it, '' for none), `outlives` ('1' for a background
  response's) and `first` (the number of the oldest event kept);
- `<prefix>S:events`, a Redis stream: event N under the entry id `0-(N+1)`, then an entry `end` when it has ended;
  trimmed to what the producer's own buffer keeps (`--stream-resume-max-chars`);
- `<prefix>S:followed`, present while a process other than the producer's follows it (each follower renews it).
While the stream runs, the producer renews their expiry every REFRESH_S (so the keys of a process that died go
soon after it); once it has ended, they expire after the grace period, when the producer forgets it too. A stop
asked elsewhere is published on `<prefix>stop` (the stream's id), where the producing processes listen; so is a
cancel or delete of a background response another process runs (server/stored_responses.py).

Redis holds a copy: the producer's process serves its own followers from its buffer, so a Redis that is down or
slow only costs the other processes' resumes (they answer 503), never the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis.asyncio as redis
from prometheus_client import CollectorRegistry, Counter
from redis.exceptions import RedisError

from llmserve.server.errors import APIError
from llmserve.server.streaming import (
    SSE_DONE,
    EventsDropped,
    ResumeLimits,
    StreamRegistry,
    dropped_events,
    sse,
)

if TYPE_CHECKING:
    from redis.asyncio.client import Pipeline

    from llmserve.server.streaming import ResumableStream

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "llmserve:stream:"
REFRESH_S = 5.0  # a running stream's keys are renewed at least this often
LIVE_TTL_S = 30.0  # and expire this long after the last renewal (the producer died)
READ_BLOCK_MS = 100  # the reader of followed streams waits this long for new events (a new follower, at most)
STOP_TIMEOUT_S = 10.0  # a stop asked elsewhere waits this long for the stream's end
STOP_POLL_S = 0.02  # looking whether it has ended this often
RETRY_S = (0.1, 0.5, 2.0)  # between copies that failed (the last one repeats)
REDIS_TIMEOUT_S = 3.0  # a Redis reply that takes longer fails
BATCH = 512  # events of one stream read at once from Redis
CONNECTIONS = 16  # to Redis from one process (the stop listener holds one), besides the reader's


def _client(url: str, connections: int, timeout_s: float) -> redis.Redis:
    """A client of at most `connections` connections; a command waits for a free one (up to REDIS_TIMEOUT_S)."""
    pool = redis.BlockingConnectionPool.from_url(url, max_connections=connections, timeout=REDIS_TIMEOUT_S,
                                                 socket_timeout=timeout_s, socket_connect_timeout=REDIS_TIMEOUT_S)
    return redis.Redis.from_pool(pool)


def stream_registry(limits: ResumeLimits | None, redis_url: str | None,
                    metrics: CollectorRegistry | None = None) -> StreamRegistry:
    """A process's resumable streams: shared with the processes of `redis_url`'s Redis when given (its failures
    counted in `metrics`)."""
    limits = limits or ResumeLimits()
    return StreamRegistry(limits, StreamMirror(redis_url, limits, metrics=metrics) if redis_url else None)


def _error_counter(registry: CollectorRegistry | None) -> Counter:
    return Counter(
        "llmserve:shared_stream_errors", "Redis operations of the resumable streams shared through --redis-url "
        "that failed, by operation: copy (a write of this process's streams, retried), lookup (a resume answered "
        "503), follow (a client following another process's stream got an error event), stop (asking another "
        "process to stop a stream or a background response), listen (listening for stops, reconnecting).",
        ["operation"], registry=registry,
    )


def stream_failed() -> APIError:
    return APIError(503, "The stream's events could not be read from the shared stream store.",
                    code="stream_store_unavailable", headers={"Retry-After": "1"})


@dataclass(frozen=True)
class _Keys:
    meta: str
    events: str
    followed: str

    @classmethod
    def of(cls, prefix: str, stream_id: str) -> _Keys:
        base = prefix + stream_id
        return cls(base, f"{base}:events", f"{base}:followed")


def _event_number(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[1]) - 1


@dataclass
class _Copy:
    """What Redis holds of one stream this process produces, as far as the copier knows."""

    stream: ResumableStream
    keys: _Keys
    copied: int | None = 0  # events in Redis (None: unknown after a failed write, read again)
    first: int | None = None  # the hash's `first` (None: the hash is not written)
    trimmed_to: int = 0  # events below this number were trimmed
    ended: bool = False  # the end entry is in Redis
    expiring: bool = False  # both keys have an expiry
    renewed: float = -float("inf")  # loop time of the last renewal

    def plan(self, pipe: Pipeline, now: float, closing: bool, grace_ms: int) -> _Write | None:
        """Queue on `pipe` what brings Redis up to date with the stream; None when nothing is to be done."""
        stream, keys = self.stream, self.keys
        finished, forgotten = stream.finished, stream.forgotten  # before the events: an end seen, all are in
        if finished and (forgotten or closing):
            if closing and self.ended:  # a whole copy left by a closing process expires with time
                return _Write(0, done=True)
            pipe.delete(keys.meta, keys.events, keys.followed)
            return _Write(1, done=True)
        if self.ended or self.copied is None:
            return None
        start = max(self.copied, stream.first_kept)
        events = stream.events_from(start)
        renew = finished or now - self.renewed >= REFRESH_S or (bool(events) and not self.expiring)
        if not events and not renew and not finished and self.first == stream.first_kept:
            return None
        commands = 0
        if self.first != stream.first_kept:
            pipe.hset(keys.meta, mapping={"owner": stream.owner or "", "outlives": int(stream.outlives_followers),
                                          "first": stream.first_kept})
            commands += 1
        for number, event in enumerate(events, start):
            pipe.xadd(keys.events, {"e": event}, id=f"0-{number + 1}")
        commands += len(events)
        if stream.first_kept > self.trimmed_to:
            pipe.xtrim(keys.events, minid=f"0-{stream.first_kept + 1}")
            commands += 1
        end = start + len(events)
        if finished:
            pipe.xadd(keys.events, {"end": "1"}, id=f"0-{end + 1}")
            commands += 1
        if renew:
            ttl_ms = grace_ms if finished else int(1000 * LIVE_TTL_S)
            pipe.pexpire(keys.meta, ttl_ms)
            pipe.pexpire(keys.events, ttl_ms)
            commands += 2
        return _Write(commands, copied=end, first=stream.first_kept, ended=finished,
                      expiring=self.expiring or (renew and (end > 0 or finished)), renewed=now if renew else None)

    def written(self, write: _Write) -> None:
        self.copied, self.first, self.trimmed_to, self.ended = write.copied, write.first, write.first, write.ended
        self.expiring = write.expiring
        if write.renewed is not None:
            self.renewed = write.renewed

    def lost(self) -> None:
        """A write failed: what Redis holds is read again before the next."""
        self.copied, self.first, self.expiring = None, None, False


@dataclass
class _Write:
    commands: int
    done: bool = False  # the copy is over (deleted, or left to expire)
    copied: int = 0
    first: int = 0
    ended: bool = False
    expiring: bool = False
    renewed: float | None = None


class StreamMirror:
    """The Redis side of one process's resumable streams: copies those it produces (one task writes every stream's
    new events at once, so that under load a write carries many), follows and stops those that others produce."""

    def __init__(self, url: str, limits: ResumeLimits, prefix: str = DEFAULT_PREFIX,
                 metrics: CollectorRegistry | None = None) -> None:
        self.limits = limits
        self.prefix = prefix
        self.errors = _error_counter(metrics)
        self._redis = _client(url, CONNECTIONS, REDIS_TIMEOUT_S)
        self._copies: dict[str, _Copy] = {}
        self._changed: set[str] = set()  # ids of the copies whose stream changed since the last write
        self._wake = asyncio.Event()
        self._copier: asyncio.Task[None] | None = None
        self._listener: asyncio.Task[None] | None = None
        self._stop_handlers: dict[str, Callable[[str], None]] = {}
        self._closing = asyncio.Event()
        self._idle = asyncio.Event()  # no copy left
        self.reader = _Reader(url)

    @property
    def stop_channel(self) -> str:
        return f"{self.prefix}stop"

    def _keys(self, stream_id: str) -> _Keys:
        return _Keys.of(self.prefix, stream_id)

    # ---- the producer's side ------------------------------------------------------------------------------

    def copy(self, stream: ResumableStream, stop_here: Callable[[str], None]) -> None:
        """Copy `stream`'s events into Redis until it is forgotten; `stop_here(id)` stops a stream of this process
        when another process asks."""
        self.on_stop("streams", stop_here)
        self._copies[stream.id] = _Copy(stream, self._keys(stream.id))
        self._idle.clear()
        if self._copier is None:
            self._copier = asyncio.ensure_future(self._copy_all())
        self.changed(stream)

    def changed(self, stream: ResumableStream) -> None:
        """`stream` has a new event, has ended, or is forgotten."""
        if stream.id in self._copies:
            self._changed.add(stream.id)
            self._wake.set()

    async def _copy_all(self) -> None:
        """Write what changed, all streams in one pipeline, while something changes; renew the running streams'
        expiry every REFRESH_S. A write that fails is retried after a pause (the streams meanwhile go on)."""
        failures = 0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), REFRESH_S / 2)
            self._wake.clear()
            changed, self._changed = self._changed, set()
            try:
                await self._write({*changed, *self._due()})
                failures = 0
            except RedisError as exc:
                self.errors.labels("copy").inc()
                if failures == 0:
                    logger.warning("copying resumable streams to Redis failed (%s); retrying", exc)
                failures += 1
                self._changed |= set(self._copies)  # all of them are read again, then written
                for copy in self._copies.values():
                    copy.lost()
                if self._closing.is_set():
                    return  # what is in Redis expires with time
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._closing.wait(), RETRY_S[min(failures, len(RETRY_S)) - 1])
                self._wake.set()

    def _due(self) -> list[str]:
        """The copies whose expiry is due for renewal."""
        now = asyncio.get_running_loop().time()
        return [stream_id for stream_id, copy in self._copies.items()
                if not copy.ended and now - copy.renewed >= REFRESH_S]

    async def _write(self, stream_ids: set[str]) -> None:
        copies = [self._copies[stream_id] for stream_id in stream_ids if stream_id in self._copies]
        await self._read_lost(copies)
        pipe = self._redis.pipeline(transaction=False)
        now, closing = asyncio.get_running_loop().time(), self._closing.is_set()
        grace_ms = int(1000 * self.limits.grace_seconds)
        planned = [(copy, write) for copy in copies
                   if (write := copy.plan(pipe, now, closing, grace_ms)) is not None]
        results = await pipe.execute(raise_on_error=False) if len(pipe) else []
        position = 0
        for copy, write in planned:
            failed = [r for r in results[position : position + write.commands] if isinstance(r, Exception)]
            position += write.commands
            if failed:  # an id already written by a write that seemed to fail, say: read what Redis has
                self.errors.labels("copy").inc()
                copy.lost()
                self._changed.add(copy.stream.id)
                self._wake.set()
            elif write.done:
                del self._copies[copy.stream.id]
            else:
                copy.written(write)
        if not self._copies:
            self._idle.set()

    async def _read_lost(self, copies: list[_Copy]) -> None:
        """How many events Redis has of the copies whose last write failed (it may have landed)."""
        lost = [copy for copy in copies if copy.copied is None]
        if not lost:
            return
        pipe = self._redis.pipeline(transaction=False)
        for copy in lost:
            pipe.xrevrange(copy.keys.events, count=1)
        for copy, last in zip(lost, await pipe.execute(), strict=True):
            copy.copied = 0 if not last else _event_number(last[0][0]) + (0 if b"end" in last[0][1] else 1)
            copy.ended = bool(last) and b"end" in last[0][1]

    def on_stop(self, name: str, handler: Callable[[str], None]) -> None:
        """Call `handler(id)` when another process is asked to stop `id` (a stream, a background response) that
        this process may run; `name` keeps one handler per kind of work. The first handler starts listening."""
        self._stop_handlers[name] = handler
        if self._listener is None:
            self._listener = asyncio.ensure_future(self._listen())

    async def ask_stop(self, work_id: str) -> None:
        """Ask the process running `work_id` to stop it (at most once: it may have stopped already)."""
        try:
            await self._redis.publish(self.stop_channel, work_id)
        except RedisError as exc:
            self.errors.labels("stop").inc()
            logger.warning("asking the other processes to stop %s through Redis failed (%s)", work_id, exc)

    async def _listen(self) -> None:
        """Stop the work of this process that another process was asked to stop."""
        while True:
            try:
                async with self._redis.pubsub() as pubsub:
                    await pubsub.subscribe(self.stop_channel)
                    while True:
                        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                        if message is not None:
                            for handler in list(self._stop_handlers.values()):
                                handler(message["data"].decode())
            except RedisError as exc:
                self.errors.labels("listen").inc()
                logger.warning("listening for stream stops in Redis failed (%s); retrying", exc)
                await asyncio.sleep(RETRY_S[-1])

    async def followed_elsewhere(self, stream_id: str) -> bool:
        """Whether a process other than this one follows the stream (False when Redis cannot say)."""
        try:
            return bool(await self._redis.exists(self._keys(stream_id).followed))
        except RedisError:
            return False

    # ---- other processes' streams -------------------------------------------------------------------------

    async def lookup(self, stream_id: str, owner: str | None) -> RemoteStream | None:
        """The stream another process produces, if `owner` may follow it."""
        keys = self._keys(stream_id)
        try:
            meta = await self._redis.hgetall(keys.meta)
        except RedisError:
            self.errors.labels("lookup").inc()
            raise stream_failed() from None
        if not meta or meta[b"owner"].decode() != (owner or ""):
            return None
        return RemoteStream(self, stream_id, owner, keys, int(meta[b"first"]), meta[b"outlives"] == b"1")

    def closing(self) -> None:
        """The process is closing: the streams it finished stay in Redis until they expire."""
        self._closing.set()

    async def close(self) -> None:
        """Write the ends of the streams (they have been stopped) unless Redis fails, then disconnect."""
        self._closing.set()
        self._changed |= set(self._copies)
        self._wake.set()
        if self._copier is not None and self._copies:
            idle = asyncio.ensure_future(self._idle.wait())
            await asyncio.wait([idle, self._copier], timeout=REDIS_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
            idle.cancel()
        for task in (self._copier, self._listener):
            if task is not None:
                task.cancel()
        await self.reader.close()
        await self._redis.aclose()


class _Reader:
    """One blocking XREAD, on a connection of its own, for every stream this process follows in Redis: however many
    clients follow streams of other processes, they hold one connection between them."""

    def __init__(self, url: str) -> None:
        # Its replies wait up to READ_BLOCK_MS on purpose: their timeout is above that.
        self._redis = _client(url, 1, REDIS_TIMEOUT_S + READ_BLOCK_MS / 1000)
        self._followers: set[_Follower] = set()
        self._task: asyncio.Task[None] | None = None

    def add(self, follower: _Follower) -> None:
        self._followers.add(follower)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._read())

    def remove(self, follower: _Follower) -> None:
        self._followers.discard(follower)

    async def _read(self) -> None:
        while self._followers:
            after: dict[str, int] = {}  # each stream's events from the number its furthest-behind follower needs
            for follower in self._followers:
                after[follower.key] = min(after.get(follower.key, follower.number), follower.number)
            try:
                reply = await self._redis.xread({key: f"0-{number}" for key, number in after.items()},
                                                count=BATCH, block=READ_BLOCK_MS)
            except RedisError as exc:
                for follower in list(self._followers):
                    follower.failed(exc)
                self._followers.clear()
                return
            entries = {key.decode(): found for key, found in reply or ()}
            now = asyncio.get_running_loop().time()
            for follower in list(self._followers):
                found = entries.get(follower.key)
                if found or now - follower.delivered >= READ_BLOCK_MS / 1000:
                    follower.deliver(found or [], now)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self._redis.aclose()


class _Follower:
    """One client following a stream of another process: the entries the reader found for it, queued."""

    def __init__(self, key: str, number: int) -> None:
        self.key = key
        self.number = number  # the next event it needs
        self.delivered = -float("inf")  # loop time of the last delivery (one comes every READ_BLOCK_MS at least)
        self.queue: asyncio.Queue[list[tuple[bytes, dict[bytes, bytes]]] | RedisError] = asyncio.Queue()

    def deliver(self, entries: list[tuple[bytes, dict[bytes, bytes]]], now: float) -> None:
        self.delivered = now
        fresh = [entry for entry in entries if _event_number(entry[0]) >= self.number]
        if fresh:
            self.number = _event_number(fresh[-1][0]) + 1
        self.queue.put_nowait(fresh)  # empty too: the follower renews its presence

    def failed(self, exc: RedisError) -> None:
        self.queue.put_nowait(exc)


class RemoteStream:
    """A resumable stream another process produces, followed through its copy in Redis."""

    def __init__(
        self, mirror: StreamMirror, stream_id: str, owner: str | None, keys: _Keys, first_kept: int, outlives: bool
    ) -> None:
        self.id = stream_id
        self.owner = owner
        self.outlives_followers = outlives
        self.first_kept = first_kept
        self._mirror = mirror
        self._redis = mirror._redis
        self._keys = keys

    def check_resumable_after(self, last_event: int) -> None:
        if last_event + 1 < self.first_kept:
            raise EventsDropped()

    async def follow(self, last_event: int = -1) -> AsyncIterator[str]:
        """The events after `last_event`, then the live ones as the producer copies them, to the stream's end."""
        follower = _Follower(self._keys.events, last_event + 1)
        self._mirror.reader.add(follower)
        try:
            async for event in self._events(follower):
                yield event
        finally:
            self._mirror.reader.remove(follower)

    async def _events(self, follower: _Follower) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        # Renewed every READ_BLOCK_MS at most, so it outlasts the wait between renewals.
        presence_ms = int(1000 * self._mirror.limits.grace_seconds) + 2 * READ_BLOCK_MS
        renewed = -float("inf")
        number = follower.number
        while True:
            found = await follower.queue.get()
            try:
                if isinstance(found, RedisError):
                    raise found
                if loop.time() - renewed >= READ_BLOCK_MS / 2000:
                    await self._redis.set(self._keys.followed, "1", px=presence_ms)
                    renewed = loop.time()
                gone = not found and not await self._redis.exists(self._keys.meta)
            except RedisError as exc:
                self._mirror.errors.labels("follow").inc()
                logger.warning("following stream %s in Redis failed (%s)", self.id, exc)
                yield sse(stream_failed().body_json())
                yield SSE_DONE
                return
            if gone:  # its producer died: its copy expired before the end
                yield sse(APIError(502, "The process producing the stream stopped before its end.",
                                   code="stream_failed").body_json())
                yield SSE_DONE
                return
            for entry_id, fields in found:
                if b"end" in fields:
                    return
                if _event_number(entry_id) != number:  # trimmed: the follower fell too far behind
                    yield sse(dropped_events(self.id).body_json())
                    yield SSE_DONE
                    return
                yield fields[b"e"].decode()
                number += 1

    async def stop(self) -> None:
        """Ask the producing process to stop the stream, and wait for its end (at most STOP_TIMEOUT_S)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STOP_TIMEOUT_S
        asked = -float("inf")
        try:
            while loop.time() < deadline:
                if loop.time() - asked >= 1.0:
                    # Asked again each second: a process that was not yet listening when first asked hears it then.
                    await self._redis.publish(self._mirror.stop_channel, self.id)
                    asked = loop.time()
                last = await self._redis.xrevrange(self._keys.events, count=1)
                if not last or b"end" in last[0][1]:
                    return
                await asyncio.sleep(STOP_POLL_S)
        except RedisError:
            self._mirror.errors.labels("stop").inc()
            raise stream_failed() from None
