"""Rate limiter: RPM/TPM over a sliding 60 s window, in process and on a real Redis, on a stepped clock
(the Redis scripts take the time from the caller when given a clock), plus Redis faults: a hung Redis,
the circuit breaker, and the failure modes.

Redis tests use a unique key prefix each and delete their keys; they skip only when Redis is down.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import random
import statistics
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import pytest
import redis
import redis.asyncio
from prometheus_client import CollectorRegistry, generate_latest

from llmserve.platform.keys import ApiKey
from llmserve.platform.ratelimit import (
    InProcessRateLimiter,
    Limits,
    RateLimiter,
    RateLimiterUnavailable,
    Reservation,
    format_duration,
)
from llmserve.platform.ratelimit_redis import CircuitBreaker, RedisRateLimiter

REDIS_URL = "redis://127.0.0.1:6379/0"
KEY = "key-1"


def redis_reachable() -> bool:
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def delete_keys(prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=prefix + "*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class Backend:
    """One backend under test, on a clock that moves only when the test says so."""

    name: str
    make: Callable[[FakeClock], RateLimiter]  # call inside the event loop (Redis clients bind to it)
    clock: FakeClock

    def run(self, scenario: Callable[[RateLimiter], Awaitable[Any]]) -> Any:
        async def main() -> Any:
            limiter = self.make(self.clock)
            try:
                return await scenario(limiter)
            finally:
                await limiter.close()

        return asyncio.run(main())

    def advance(self, seconds: float) -> None:
        self.clock.now += seconds


def unique_prefix() -> str:
    return f"llmserve-test:rl:{uuid.uuid4().hex}:"


@pytest.fixture(scope="module")
def redis_available() -> None:
    if not redis_reachable():
        pytest.skip(f"Redis is not reachable at {REDIS_URL}")


@pytest.fixture
def redis_prefix(redis_available: None) -> Iterator[str]:
    prefix = unique_prefix()
    try:
        yield prefix
    finally:
        delete_keys(prefix)


@pytest.fixture(params=["inprocess", "redis"])
def backend(request: pytest.FixtureRequest) -> Backend:
    if request.param == "inprocess":
        return Backend("inprocess", lambda clock: InProcessRateLimiter(clock=clock), FakeClock())
    prefix = request.getfixturevalue("redis_prefix")
    return Backend("redis", lambda clock: RedisRateLimiter(REDIS_URL, prefix=prefix, clock=clock), FakeClock())


# --- admission and denial ---------------------------------------------------------------------------


def test_allows_rpm_requests_then_denies_until_the_first_is_a_minute_old(backend: Backend) -> None:
    limits = Limits(rpm=10)

    async def scenario(limiter: RateLimiter):
        allowed = [await limiter.acquire(KEY, limits, 0) for _ in range(10)]
        return allowed, await limiter.acquire(KEY, limits, 0)

    allowed, denied = backend.run(scenario)
    assert [r.allowed for r in allowed] == [True] * 10
    assert [r.remaining_requests for r in allowed] == [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]
    assert all(r.reservation is not None for r in allowed)
    assert (denied.allowed, denied.kind, denied.never, denied.reservation) == (False, "requests", False, None)
    assert denied.remaining_requests == 0
    assert denied.retry_after_s == 60.0  # nothing comes back before the first admission is a minute old
    assert denied.headers()["retry-after"] == "60"


def test_allows_tpm_reservations_then_denies_with_kind_tokens(backend: Backend) -> None:
    limits = Limits(rpm=100, tpm=1000)

    async def scenario(limiter: RateLimiter):
        first = await limiter.acquire(KEY, limits, 400)
        backend.advance(10)
        second = await limiter.acquire(KEY, limits, 400)
        backend.advance(10)
        denied = await limiter.acquire(KEY, limits, 400)
        backend.advance(denied.retry_after_s)
        return first, second, denied, await limiter.acquire(KEY, limits, 400)

    first, second, denied, retried = backend.run(scenario)
    assert (first.allowed, first.remaining_tokens) == (True, 600)
    assert (second.allowed, second.remaining_tokens) == (True, 200)
    assert (denied.allowed, denied.kind) == (False, "tokens")
    assert denied.remaining_requests == 98  # a denied request takes nothing
    assert denied.retry_after_s == 40.0  # the first 400 leave the window 60 s after they came in
    assert denied.message is not None and "1000 tokens per minute" in denied.message
    assert (retried.allowed, retried.remaining_tokens) == (True, 200)


def test_when_both_limits_deny_the_longer_wait_is_reported(backend: Backend) -> None:
    limits = Limits(rpm=2, tpm=100)

    async def scenario(limiter: RateLimiter):
        await limiter.acquire(KEY, limits, 60)  # t=0
        backend.advance(30)
        await limiter.acquire(KEY, limits, 0)  # t=30: the RPM limit is now spent until t=60
        backend.advance(10)
        return await limiter.acquire(KEY, limits, 50)  # tokens fit once t=0 expires: 20 s

    denied = backend.run(scenario)
    assert (denied.kind, denied.retry_after_s) == ("requests", 20.0)


@pytest.mark.parametrize("dimension", ["requests", "tokens"])
@pytest.mark.parametrize("per_minute", [7, 13, 600])
def test_waiting_exactly_retry_after_is_enough(backend: Backend, dimension: str, per_minute: int) -> None:
    limits = Limits(rpm=per_minute) if dimension == "requests" else Limits(tpm=per_minute)
    reserve = 0 if dimension == "requests" else 1
    rng = random.Random(per_minute)

    async def scenario(limiter: RateLimiter):
        outcomes = []
        for _ in range(3 * per_minute):
            backend.advance(rng.random() * 0.7)
            result = await limiter.acquire(KEY, limits, reserve)
            if not result.allowed:
                assert result.kind == dimension and 0.0 < result.retry_after_s <= 60.0
                backend.advance(result.retry_after_s)
                result = await limiter.acquire(KEY, limits, reserve)
            outcomes.append(result.allowed)
        return outcomes

    assert all(backend.run(scenario))


def test_reservation_larger_than_tpm_is_never_allowed(backend: Backend) -> None:
    limits = Limits(rpm=10, tpm=1000)

    async def scenario(limiter: RateLimiter):
        return await limiter.acquire(KEY, limits, 1001), await limiter.acquire(KEY, limits, 1000)

    too_large, whole_minute = backend.run(scenario)
    assert (too_large.allowed, too_large.never, too_large.kind) == (False, True, "tokens")
    assert too_large.retry_after_s is None
    assert (too_large.remaining_tokens, too_large.remaining_requests) == (1000, 10)  # nothing taken
    assert "retry-after" not in too_large.headers() and "retry-after-ms" not in too_large.headers()
    assert too_large.message is not None and too_large.message.startswith("Request too large")
    assert (whole_minute.allowed, whole_minute.remaining_tokens) == (True, 0)


def test_unlimited_dimensions_never_deny_and_have_no_headers(backend: Backend) -> None:
    async def scenario(limiter: RateLimiter):
        unlimited = [await limiter.acquire(KEY, Limits(), 10**9) for _ in range(50)]
        return unlimited, await limiter.acquire("other", Limits(rpm=5), 10**9)

    unlimited, requests_only = backend.run(scenario)
    assert all(r.allowed and r.headers() == {} for r in unlimited)
    assert requests_only.allowed
    assert set(requests_only.headers()) == {
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
    }


def test_new_limits_apply_at_once(backend: Backend) -> None:
    async def scenario(limiter: RateLimiter):
        for _ in range(5):
            await limiter.acquire(KEY, Limits(rpm=5), 0)
        slow = await limiter.acquire(KEY, Limits(rpm=5), 0)
        fast = await limiter.acquire(KEY, Limits(rpm=600), 0)
        return slow, fast, await limiter.acquire(KEY, Limits(), 0)

    slow, fast, unlimited = backend.run(scenario)
    assert not slow.allowed
    assert (fast.allowed, fast.remaining_requests) == (True, 594)  # the 5 earlier ones still count
    assert unlimited.allowed


# --- the sliding-window property --------------------------------------------------------------------


@dataclass
class Admitted:
    at: float
    reserved: int
    charged: int  # the reservation until settled, then what was used


def _random_arrivals(rng: random.Random, count: int, tpm: int) -> list[tuple[float, int]]:
    """Arrival times on a 1/64 s grid (exact floats), in bursts and lulls, and reservation sizes."""
    arrivals, now = [], 1000.0
    for _ in range(count):
        gap = rng.choice([0.0, 0.0, 1 / 64, 0.25, 1.0, 3.0, 7.5, 20.0, rng.randrange(0, 90 * 64) / 64])
        now += gap
        size = rng.choice([rng.randrange(0, tpm // 10), rng.randrange(0, tpm // 2), rng.randrange(0, tpm + 50)])
        arrivals.append((now, size))
    return arrivals


async def _drive(
    limiter: RateLimiter, clock: FakeClock, rng: random.Random, limits: Limits, arrivals: list[tuple[float, int]]
) -> tuple[list[Admitted], list[bool]]:
    """Send the arrivals in order; settle some admissions later (to a random usage), as requests end."""
    admitted: list[Admitted] = []
    decisions: list[bool] = []
    pending: list[tuple[float, Reservation, Admitted, int]] = []
    for at, size in arrivals:
        for due in sorted((p for p in pending if p[0] <= at), key=lambda p: p[0]):
            pending.remove(due)
            settle_at, reservation, entry, used = due
            clock.now = settle_at
            await limiter.settle(reservation, used)
            entry.charged = min(used, entry.reserved)
        clock.now = at
        result = await limiter.acquire(KEY, limits, size)
        decisions.append(result.allowed)
        if result.allowed:
            entry = Admitted(at, size, size)
            admitted.append(entry)
            if rng.random() < 0.6:
                used = rng.randrange(0, size + 1) if rng.random() < 0.9 else size + 10
                pending.append((at + rng.choice([0.0, 0.5, 5.0, 30.0, 70.0]), result.reservation, entry, used))
        elif not result.never:
            # Denied only when it would not fit: what counts now, plus what sits in the same 1/8 s slot
            # as an admission that does (a slot expires with its last admission).
            counted = [a for a in admitted if at - a.at < 60.0 + 1 / 8]
            over_rpm = limits.rpm is not None and len(counted) + 1 > limits.rpm
            assert over_rpm or sum(a.charged for a in counted) + size > (limits.tpm or 0), (at, size)
    return admitted, decisions


def _assert_every_minute_within_limits(admitted: list[Admitted], limits: Limits) -> None:
    """For every 60 s window [start, start + 60) (it suffices to start one at each admission).

    Issue 13 allows the limit plus one reservation; the sliding window holds the limit exactly.
    """
    for first in admitted:
        in_window = [a for a in admitted if first.at <= a.at < first.at + 60.0]
        tokens = sum(a.charged for a in in_window)
        assert tokens <= (limits.tpm or 0), (first.at, tokens)
        if limits.rpm is not None:
            assert len(in_window) <= limits.rpm


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_tokens_and_requests_admitted_in_any_minute_stay_within_the_limits(backend: Backend, seed: int) -> None:
    """The issue's finding: a token bucket admitted 1,644 tokens in one rolling minute with tpm=1000."""
    limits = Limits(rpm=40, tpm=1000) if seed == 3 else Limits(tpm=1000)
    rng = random.Random(seed)
    arrivals = _random_arrivals(rng, 400, limits.tpm or 0)

    admitted, decisions = backend.run(lambda limiter: _drive(limiter, backend.clock, rng, limits, arrivals))
    _assert_every_minute_within_limits(admitted, limits)
    assert 50 < len(admitted) < len(arrivals)  # the limit, not something else, decided


@pytest.mark.usefixtures("redis_available")
def test_redis_decides_exactly_as_in_process(redis_prefix: str) -> None:
    limits = Limits(rpm=30, tpm=1000)
    arrivals = _random_arrivals(random.Random(7), 300, 1000)
    local = Backend("inprocess", lambda clock: InProcessRateLimiter(clock=clock), FakeClock())
    shared = Backend("redis", lambda clock: RedisRateLimiter(REDIS_URL, prefix=redis_prefix, clock=clock), FakeClock())
    _, local_decisions = local.run(lambda limiter: _drive(limiter, local.clock, random.Random(8), limits, arrivals))
    _, redis_decisions = shared.run(lambda limiter: _drive(limiter, shared.clock, random.Random(8), limits, arrivals))
    assert redis_decisions == local_decisions
    assert local_decisions.count(False) > 20


# --- settling ---------------------------------------------------------------------------------------


def test_settle_refunds_unused_tokens_once(backend: Backend) -> None:
    limits = Limits(tpm=1000)

    async def scenario(limiter: RateLimiter):
        first = await limiter.acquire(KEY, limits, 800)
        await limiter.settle(first.reservation, 300)  # 500 back: 700 left
        await limiter.settle(first.reservation, 0)  # a second settle gives nothing
        second = await limiter.acquire(KEY, limits, 600)  # fits only thanks to the refund
        await limiter.settle(second.reservation, 5000)  # used more than reserved: takes nothing extra
        return first, second, await limiter.acquire(KEY, limits, 0)

    first, second, after = backend.run(scenario)
    assert (first.remaining_tokens, first.reservation.settled) == (200, True)
    assert (second.allowed, second.remaining_tokens, after.remaining_tokens) == (True, 100, 100)


@pytest.mark.parametrize("tpm", [1000, None])
def test_a_withdrawn_request_gives_back_its_request_and_all_its_tokens(backend: Backend, tpm: int | None) -> None:
    limits = Limits(rpm=2, tpm=tpm)

    async def scenario(limiter: RateLimiter):
        kept = await limiter.acquire(KEY, limits, 300)
        withdrawn = await limiter.acquire(KEY, limits, 500)
        await limiter.settle(withdrawn.reservation, 0, withdrawn=True)
        await limiter.settle(withdrawn.reservation, 0, withdrawn=True)  # a second settle gives nothing
        return kept, await limiter.acquire(KEY, limits, 100), await limiter.acquire(KEY, limits, 0)

    kept, second, third = backend.run(scenario)
    assert kept.allowed and second.allowed and not third.allowed  # the withdrawn request left no trace
    assert second.remaining_requests == 0
    if tpm is not None:
        assert second.remaining_tokens == tpm - 300 - 100


def test_settling_after_the_reservation_left_the_window_gives_nothing_back(backend: Backend) -> None:
    limits = Limits(tpm=1000)

    async def scenario(limiter: RateLimiter):
        old = await limiter.acquire(KEY, limits, 900)
        backend.advance(60)
        recent = await limiter.acquire(KEY, limits, 600)
        await limiter.settle(old.reservation, 0)  # a minute late: it no longer counts anyway
        return recent, await limiter.acquire(KEY, limits, 0)

    recent, after = backend.run(scenario)
    assert (recent.remaining_tokens, after.remaining_tokens) == (400, 400)


# --- concurrency ------------------------------------------------------------------------------------


def test_concurrent_tasks_never_exceed_the_limit(backend: Backend) -> None:
    limits = Limits(rpm=10_000, tpm=5000)

    async def scenario(limiter: RateLimiter):
        return await asyncio.gather(*(limiter.acquire(KEY, limits, 100) for _ in range(200)))

    results = backend.run(scenario)
    assert sum(r.allowed for r in results) == 50
    assert {r.kind for r in results if not r.allowed} == {"tokens"}


def test_in_process_threads_never_exceed_the_limit() -> None:
    limiter = InProcessRateLimiter(clock=FakeClock())
    limits = Limits(rpm=100)
    admitted: list[int] = []

    async def burst() -> int:
        return sum([(await limiter.acquire(KEY, limits, 0)).allowed for _ in range(50)])

    threads = [threading.Thread(target=lambda: admitted.append(asyncio.run(burst()))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(admitted) == 8 and sum(admitted) == 100


def _burst_in_own_process(prefix: str, barrier_key: str, attempts: int, results: Any) -> None:
    """One replica on the Redis server's clock: its own client, a Redis-counted barrier, then
    `attempts` concurrent acquires."""

    async def main() -> int:
        limiter = RedisRateLimiter(REDIS_URL, prefix=prefix)
        client = redis.asyncio.Redis.from_url(REDIS_URL)
        try:
            await client.incr(barrier_key)
            deadline = time.monotonic() + 30
            while int(await client.get(barrier_key)) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            limits = Limits(tpm=5000)
            outcome = await asyncio.gather(*(limiter.acquire(KEY, limits, 100) for _ in range(attempts)))
            return sum(r.allowed for r in outcome)
        finally:
            await client.aclose()
            await limiter.close()

    results.put(asyncio.run(main()))


def test_redis_two_processes_share_one_limit(redis_prefix: str) -> None:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    barrier_key = redis_prefix + "barrier"
    workers = [
        context.Process(target=_burst_in_own_process, args=(redis_prefix, barrier_key, 100, results))
        for _ in range(2)
    ]
    for worker in workers:
        worker.start()
    admitted = [results.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(timeout=30)
    assert [worker.exitcode for worker in workers] == [0, 0]
    assert 100 * sum(admitted) == 5000  # within a minute on the server's clock: the limit, exactly


# --- headers ----------------------------------------------------------------------------------------


def test_headers_exact_for_known_states(backend: Backend) -> None:
    limits = Limits(rpm=10, tpm=6000)

    async def scenario(limiter: RateLimiter):
        third = [await limiter.acquire(KEY, limits, 100) for _ in range(3)][-1]
        backend.advance(1.5)
        for _ in range(7):
            await limiter.acquire(KEY, limits, 100)
        denied = await limiter.acquire(KEY, limits, 100)
        backend.advance(denied.retry_after_s)
        return third, denied, await limiter.acquire(KEY, limits, 100)

    third, denied, later = backend.run(scenario)
    assert third.headers() == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "7",
        "x-ratelimit-reset-requests": "1m0s",  # all three leave the window a minute from now
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "5700",
        "x-ratelimit-reset-tokens": "1m0s",
    }
    assert denied.headers() == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1m0s",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "5000",
        "x-ratelimit-reset-tokens": "1m0s",
        "retry-after": "59",  # the first three leave 58.5 s from now
        "retry-after-ms": "58500",
    }
    assert later.headers() == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "2",
        "x-ratelimit-reset-requests": "1m0s",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "5200",
        "x-ratelimit-reset-tokens": "1m0s",
    }


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0s"),
        (0.02, "20ms"),
        (0.0001, "1ms"),  # rounded up: never advertise less than the real wait
        (0.999, "999ms"),
        (1.0, "1s"),
        (1.5, "1.5s"),
        (17.28, "17.28s"),
        (18.000000000000004, "18s"),  # float noise adds no millisecond
        (59.9999, "1m0s"),
        (90.0, "1m30s"),
        (360.0, "6m0s"),
        (3661.25, "1h1m1.25s"),
    ],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_format_duration_rejects_negative() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        format_duration(-0.5)


# --- bad inputs -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs", [{"rpm": 0}, {"rpm": -1}, {"tpm": 0}, {"tpm": -100}, {"rpm": 1.5}, {"tpm": True}, {"rpm": "10"}]
)
def test_invalid_limits_raise(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="must be a positive integer or None"):
        Limits(**kwargs)


@pytest.mark.parametrize("reserve", [-1, 2.5, None])
def test_invalid_reservation_raises(backend: Backend, reserve: Any) -> None:
    async def scenario(limiter: RateLimiter):
        with pytest.raises(ValueError, match="reserve_tokens"):
            await limiter.acquire(KEY, Limits(tpm=100), reserve)

    backend.run(scenario)


def test_settle_validates_used_tokens() -> None:
    async def scenario(limiter: RateLimiter):
        result = await limiter.acquire(KEY, Limits(tpm=100), 10)
        with pytest.raises(ValueError, match="used_tokens"):
            await limiter.settle(result.reservation, -1)

    Backend("inprocess", lambda clock: InProcessRateLimiter(clock=clock), FakeClock()).run(scenario)


def test_in_process_forgets_idle_windows() -> None:
    clock = FakeClock()
    limiter = InProcessRateLimiter(clock=clock)

    async def scenario() -> None:
        for index in range(1000):
            await limiter.acquire(f"key-{index}", Limits(rpm=1), 0)
        assert len(limiter) == 1000
        clock.now += 60.0
        result = await limiter.acquire("key-0", Limits(rpm=1), 0)
        assert result.allowed  # its only admission has left the window
        assert len(limiter) == 1

    asyncio.run(scenario())


def test_make_rate_limiter_picks_the_backend() -> None:
    from llmserve.server.platform_options import make_rate_limiter

    async def scenario() -> None:
        local = make_rate_limiter(None)
        shared = make_rate_limiter(REDIS_URL, redis_timeout_ms=50)
        try:
            assert isinstance(local, InProcessRateLimiter)
            assert isinstance(shared, RedisRateLimiter)
        finally:
            await local.close()
            await shared.close()

    asyncio.run(scenario())


# --- Redis faults -----------------------------------------------------------------------------------

BREAKER_LOGGER = "llmserve.platform.ratelimit_redis"


@pytest.fixture
def hung_redis_url(hung_redis_port: int) -> str:
    return f"redis://user:s3cret@127.0.0.1:{hung_redis_port}/0"


class HangingRedisProxy:
    """A TCP front for the real Redis which, while `hung`, takes connections and never answers."""

    def __init__(self) -> None:
        self.hung = True
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/0"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.hung:
            await reader.read()  # until the client gives up
        else:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", 6379)
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
        writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


def _platform(limiter: RateLimiter, mode: str) -> Any:
    from llmserve.server.gateway import Platform
    from llmserve.server.metrics import PlatformMetrics

    return Platform(limiter=limiter, metrics=PlatformMetrics(CollectorRegistry()), rate_limit_failure_mode=mode)


def _without_redis(platform: Any, outcome: str) -> float:
    text = generate_latest(platform.metrics.registry).decode()
    prefix = f'llmserve:rate_limit_decisions_without_redis_total{{model_name="m",outcome="{outcome}"}} '
    return next((float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


LIMITED_KEY = ApiKey(
    id="k1", name="limited", prefix="x", tier="default", rpm=5, tpm=1000, models=None, is_admin=False,
    created_at=datetime.now(timezone.utc), revoked_at=None,
)


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_a_hung_redis_costs_little_once_the_breaker_is_open(
    hung_redis_url: str, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    from llmserve.server.errors import APIError

    async def admit(platform: Any) -> tuple[float, int | None, dict | None]:
        started = time.perf_counter()
        try:
            await platform.admit(LIMITED_KEY, "m", 10)
        except APIError as error:
            return time.perf_counter() - started, error.status, {**error.body(), **(error.headers or {})}
        return time.perf_counter() - started, None, None

    async def scenario() -> None:
        limiter = RedisRateLimiter(hung_redis_url, timeout_s=0.05, breaker=CircuitBreaker("hung", 3, 30.0))
        platform = _platform(limiter, mode)
        try:
            tripping = [await admit(platform) for _ in range(3)]
            assert limiter.breaker.state == "open"
            measured = [await admit(platform) for _ in range(50)]
        finally:
            await limiter.close()
        assert all(0.04 <= seconds < 1.0 for seconds, _, _ in tripping)  # each one timed out, once
        assert statistics.median(seconds for seconds, _, _ in measured) < 0.005
        outcome = "admitted" if mode == "open" else "rejected"
        assert _without_redis(platform, outcome) == 53
        if mode == "open":
            assert {status for _, status, _ in tripping + measured} == {None}
        else:
            assert {status for _, status, _ in tripping + measured} == {503}
            _, _, answer = measured[-1]
            assert answer["error"]["code"] == "rate_limiter_unavailable"
            assert answer["error"]["type"] == "service_unavailable_error"
            assert 28 <= int(answer["Retry-After"]) <= 30  # the cool-down left

    with caplog.at_level(logging.INFO, logger=BREAKER_LOGGER):
        asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("llmserve")]
    assert len(lines) == 1 and "closed -> open" in lines[0]
    assert "s3cret" not in lines[0] and "127.0.0.1" in lines[0]


@pytest.mark.usefixtures("redis_available")
def test_the_breaker_probes_after_its_cool_down_and_closes_when_redis_answers(
    redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    breaker_clock = FakeClock()
    proxy = HangingRedisProxy()
    limits = Limits(rpm=100)

    async def attempt(limiter: RedisRateLimiter) -> bool:
        try:
            await limiter.acquire(KEY, limits, 0)
        except RateLimiterUnavailable:
            return False
        return True

    async def scenario() -> list[str]:
        url = await proxy.start()
        breaker = CircuitBreaker("proxy", failure_threshold=2, cooldown_s=10.0, clock=breaker_clock)
        limiter = RedisRateLimiter(url, prefix=redis_prefix, timeout_s=0.05, breaker=breaker)
        states = []
        try:
            for step in range(8):
                if step == 3:
                    breaker_clock.now += 10  # cool-down over: the next call is the probe, which times out
                if step == 5:
                    breaker_clock.now += 10
                    proxy.hung = False  # Redis answers again: the probe closes the circuit
                states.append(f"{await attempt(limiter)}:{breaker.state}")
        finally:
            await limiter.close()
            await proxy.stop()
        return states

    with caplog.at_level(logging.INFO, logger=BREAKER_LOGGER):
        states = asyncio.run(scenario())
    assert states == [
        "False:closed", "False:open", "False:open",  # two timeouts open it; then refused without a call
        "False:open", "False:open",  # the probe failed: open again, for another cool-down
        "True:closed", "True:closed", "True:closed",
    ]
    changes = [r.getMessage().split("(")[0].strip() for r in caplog.records if r.name == BREAKER_LOGGER]
    assert [change.rsplit(": circuit ", 1)[1] for change in changes] == [
        "closed -> open", "open -> half_open", "half_open -> open", "open -> half_open", "half_open -> closed",
    ]


def test_a_half_open_breaker_lets_one_probe_through_at_a_time() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker("unit", failure_threshold=1, cooldown_s=5.0, clock=clock)
    breaker.failed(OSError("down"))
    assert (breaker.state, breaker.allow(), breaker.retry_after_s()) == ("open", False, 5.0)
    clock.now += 5.0
    assert [breaker.allow(), breaker.allow()] == [True, False]  # the probe, then nobody while it runs
    breaker.abandoned()  # the probe was cancelled
    assert breaker.allow()
    breaker.succeeded()
    assert (breaker.state, breaker.allow(), breaker.allow()) == ("closed", True, True)


def test_redis_unreachable_raises_unavailable_without_credentials() -> None:
    async def scenario() -> None:
        limiter = RedisRateLimiter("redis://user:s3cret@127.0.0.1:1/0", timeout_s=0.5)
        try:
            with pytest.raises(RateLimiterUnavailable) as acquire_error:
                await limiter.acquire(KEY, Limits(rpm=1), 0)
            with pytest.raises(RateLimiterUnavailable):
                await limiter.check()
        finally:
            await limiter.close()
        assert "127.0.0.1:1" in str(acquire_error.value)
        assert "s3cret" not in str(acquire_error.value)

    asyncio.run(scenario())
