"""Rate limiter: RPM/TPM token buckets, in-process (fake clock, exact) and on a real Redis (real time).

Redis tests use a unique key prefix each and delete their keys; they skip only when Redis is down.
Where real time passes (Redis), upper bounds include the refill the elapsed time allows, computed.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
import redis.asyncio

from llmserve.platform.ratelimit import (
    InProcessRateLimiter,
    Limits,
    RateLimiter,
    RateLimiterUnavailable,
    format_duration,
)
from llmserve.platform.ratelimit_redis import RedisRateLimiter

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
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Backend:
    """One backend under test: how to build it, how time passes for it, and how much has passed."""

    name: str
    make: Callable[[], RateLimiter]  # call inside the event loop (Redis clients bind to it)
    advance: Callable[[float], Awaitable[None]]
    elapsed: Callable[[], float]  # time since the test started, as the limiter sees it
    prefix: str = ""
    limiters: list[RateLimiter] = field(default_factory=list)

    def run(self, scenario: Callable[[RateLimiter], Awaitable[Any]]) -> Any:
        async def main() -> Any:
            limiter = self.make()
            try:
                return await scenario(limiter)
            finally:
                await limiter.close()

        return asyncio.run(main())

    def refill(self, per_minute: int) -> float:
        """The most the bucket can have refilled since the test began."""
        return self.elapsed() * per_minute / 60.0


def in_process_backend() -> Backend:
    clock = FakeClock()
    start = clock.now

    async def advance(seconds: float) -> None:
        clock.now += seconds

    return Backend("inprocess", lambda: InProcessRateLimiter(clock=clock), advance, lambda: clock.now - start)


def redis_backend(prefix: str) -> Backend:
    start = time.monotonic()
    return Backend(
        "redis",
        lambda: RedisRateLimiter(REDIS_URL, prefix=prefix),
        asyncio.sleep,  # the wait under test is real time on the Redis server's clock
        lambda: time.monotonic() - start,
        prefix=prefix,
    )


def unique_prefix() -> str:
    return f"llmserve-test:rl:{uuid.uuid4().hex}:"


@pytest.fixture(scope="module")
def redis_available() -> None:
    if not redis_reachable():
        pytest.skip(f"Redis is not reachable at {REDIS_URL}")


@pytest.fixture(params=["inprocess", "redis"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "inprocess":
        yield in_process_backend()
        return
    request.getfixturevalue("redis_available")
    prefix = unique_prefix()
    try:
        yield redis_backend(prefix)
    finally:
        delete_keys(prefix)


@pytest.fixture
def redis_prefix(redis_available: None) -> Iterator[str]:
    prefix = unique_prefix()
    try:
        yield prefix
    finally:
        delete_keys(prefix)


# --- admission and denial ---------------------------------------------------------------------------


def test_allows_rpm_requests_then_denies_with_kind_requests(backend: Backend) -> None:
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
    # One request refills in 60/10 = 6 s, less what has already refilled.
    assert 6.0 - backend.elapsed() <= denied.retry_after_s <= 6.0
    assert denied.headers()["retry-after"] == "6"


def test_allows_tpm_reservations_then_denies_with_kind_tokens(backend: Backend) -> None:
    limits = Limits(rpm=100, tpm=1000)

    async def scenario(limiter: RateLimiter):
        first = await limiter.acquire(KEY, limits, 400)
        second = await limiter.acquire(KEY, limits, 400)
        return first, second, await limiter.acquire(KEY, limits, 400)

    first, second, denied = backend.run(scenario)
    assert (first.allowed, first.remaining_tokens) == (True, 600)
    assert (second.allowed, second.remaining_tokens) == (True, 200)
    assert (denied.allowed, denied.kind) == (False, "tokens")
    assert denied.remaining_requests == 98  # a denied request takes nothing
    # 200 more tokens at 1000/60 per second: 12 s.
    assert 12.0 - backend.elapsed() <= denied.retry_after_s <= 12.0
    assert denied.message is not None and "1000 tokens per minute" in denied.message


def test_when_both_limits_deny_the_longer_wait_is_reported(backend: Backend) -> None:
    limits = Limits(rpm=1, tpm=60)

    async def scenario(limiter: RateLimiter):
        await limiter.acquire(KEY, limits, 60)
        return await limiter.acquire(KEY, limits, 30)

    denied = backend.run(scenario)
    # Requests: 1 at 1/60 per second = 60 s; tokens: 30 at 1 per second = 30 s.
    assert denied.kind == "requests"
    assert 60.0 - backend.elapsed() <= denied.retry_after_s <= 60.0


@pytest.mark.parametrize("dimension", ["requests", "tokens"])
def test_waiting_retry_after_is_enough(backend: Backend, dimension: str) -> None:
    # 600 per minute refills 10 per second, so the wait is about 0.1 s.
    limits = Limits(rpm=600) if dimension == "requests" else Limits(tpm=600)
    reserve = 0 if dimension == "requests" else 1

    async def scenario(limiter: RateLimiter):
        admitted = 0
        while (result := await limiter.acquire(KEY, limits, reserve)).allowed and admitted < 5000:
            admitted += 1
        await backend.advance(result.retry_after_s)
        return admitted, result, await limiter.acquire(KEY, limits, reserve)

    admitted, denied, retried = backend.run(scenario)
    assert 600 <= admitted <= 600 + backend.refill(600)
    assert denied.kind == dimension
    assert 0.0 < denied.retry_after_s <= 0.1
    assert retried.allowed


def test_in_process_retry_after_is_exact() -> None:
    backend = in_process_backend()
    limits = Limits(tpm=600)

    async def scenario(limiter: RateLimiter):
        await limiter.acquire(KEY, limits, 600)
        denied = await limiter.acquire(KEY, limits, 15)
        await backend.advance(1.49)
        too_early = await limiter.acquire(KEY, limits, 15)
        await backend.advance(0.01)
        return denied, too_early, await limiter.acquire(KEY, limits, 15)

    denied, too_early, on_time = backend.run(scenario)
    assert denied.retry_after_s == pytest.approx(1.5, abs=1e-9)
    assert too_early.retry_after_s == pytest.approx(0.01, abs=1e-9)
    assert (too_early.allowed, on_time.allowed) == (False, True)


@pytest.mark.parametrize("per_minute", [7, 13, 999, 7001])
def test_in_process_waiting_exactly_retry_after_is_enough_despite_float_rounding(per_minute: int) -> None:
    backend = in_process_backend()
    limits = Limits(rpm=per_minute, tpm=per_minute)

    async def scenario(limiter: RateLimiter):
        outcomes = []
        await limiter.acquire(KEY, limits, per_minute - 1)  # tokens: 1 left
        for _ in range(per_minute + 5):
            result = await limiter.acquire(KEY, limits, 1)
            if not result.allowed:
                await backend.advance(result.retry_after_s)
                result = await limiter.acquire(KEY, limits, 1)
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
    assert slow.retry_after_s == pytest.approx(12.0, abs=backend.elapsed())  # 1 at 5/min
    assert fast.retry_after_s <= 0.1  # 1 at 600/min
    assert unlimited.allowed


# --- settling ---------------------------------------------------------------------------------------


def test_settle_refunds_unused_tokens_once(backend: Backend) -> None:
    limits = Limits(tpm=1000)

    async def scenario(limiter: RateLimiter):
        first = await limiter.acquire(KEY, limits, 800)
        await limiter.settle(first.reservation, 300)  # 500 back: 700
        await limiter.settle(first.reservation, 0)  # a second settle gives nothing
        second = await limiter.acquire(KEY, limits, 600)  # fits only thanks to the refund
        await limiter.settle(second.reservation, 5000)  # used more than reserved: takes nothing extra
        return first, second, await limiter.acquire(KEY, limits, 0)

    first, second, after = backend.run(scenario)
    assert (first.remaining_tokens, first.reservation.settled) == (200, True)
    assert second.allowed
    extra = backend.refill(1000)
    assert 100 <= second.remaining_tokens <= 100 + extra
    assert 100 <= after.remaining_tokens <= 100 + extra


def test_refund_is_capped_at_capacity(backend: Backend) -> None:
    limits = Limits(tpm=60_000)  # 1000 tokens per second

    async def scenario(limiter: RateLimiter):
        first = await limiter.acquire(KEY, limits, 60_000)
        await backend.advance(0.05)
        banked_at = time.monotonic()
        await limiter.acquire(KEY, limits, 0)  # banks the 50 refilled tokens
        await limiter.settle(first.reservation, 0)  # 60 050 uncapped
        raised = await limiter.acquire(KEY, Limits(tpm=120_000), 0)  # a raised limit shows any excess
        return raised, time.monotonic() - banked_at

    raised, since_banked = backend.run(scenario)
    assert 60_000 <= raised.remaining_tokens <= 60_000 + since_banked * 2000


def test_settle_validates_used_tokens() -> None:
    async def scenario(limiter: RateLimiter):
        result = await limiter.acquire(KEY, Limits(tpm=100), 10)
        with pytest.raises(ValueError, match="used_tokens"):
            await limiter.settle(result.reservation, -1)

    in_process_backend().run(scenario)


# --- concurrency ------------------------------------------------------------------------------------


def test_concurrent_tasks_never_exceed_capacity(backend: Backend) -> None:
    limits = Limits(rpm=10_000, tpm=5000)

    async def scenario(limiter: RateLimiter):
        return await asyncio.gather(*(limiter.acquire(KEY, limits, 100) for _ in range(200)))

    results = backend.run(scenario)
    admitted_tokens = 100 * sum(r.allowed for r in results)
    assert 5000 <= admitted_tokens <= 5000 + backend.refill(5000)
    assert {r.kind for r in results if not r.allowed} == {"tokens"}


def test_in_process_threads_never_exceed_capacity() -> None:
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
    """One replica: its own client, a Redis-counted barrier, then `attempts` concurrent acquires."""

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
    start = time.monotonic()
    workers = [
        context.Process(target=_burst_in_own_process, args=(redis_prefix, barrier_key, 100, results))
        for _ in range(2)
    ]
    for worker in workers:
        worker.start()
    admitted = [results.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(timeout=30)
    elapsed = time.monotonic() - start
    assert [worker.exitcode for worker in workers] == [0, 0]
    admitted_tokens = 100 * sum(admitted)
    assert 5000 <= admitted_tokens <= 5000 + elapsed * 5000 / 60


# --- headers ----------------------------------------------------------------------------------------


def test_headers_exact_for_known_states() -> None:
    backend = in_process_backend()
    limits = Limits(rpm=10, tpm=6000)

    async def scenario(limiter: RateLimiter):
        third = [await limiter.acquire(KEY, limits, 100) for _ in range(3)][-1]
        for _ in range(7):
            await limiter.acquire(KEY, limits, 100)
        denied = await limiter.acquire(KEY, limits, 100)
        await backend.advance(1.5)
        return third, denied, await limiter.acquire(KEY, limits, 100)

    third, denied, later = backend.run(scenario)
    assert third.headers() == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "7",
        "x-ratelimit-reset-requests": "18s",  # 3 requests at 10/min
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "5700",
        "x-ratelimit-reset-tokens": "3s",  # 300 tokens at 100/s
    }
    assert denied.headers() == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1m0s",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "5000",
        "x-ratelimit-reset-tokens": "10s",
        "retry-after": "6",
        "retry-after-ms": "6000",
    }
    assert later.headers() == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "58.5s",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "5150",
        "x-ratelimit-reset-tokens": "8.5s",
        "retry-after": "5",
        "retry-after-ms": "4500",
    }


def test_headers_match_the_bucket(backend: Backend) -> None:
    limits = Limits(rpm=10, tpm=6000)

    async def scenario(limiter: RateLimiter):
        return [await limiter.acquire(KEY, limits, 100) for _ in range(3)][-1]

    third = backend.run(scenario)
    headers = third.headers()
    assert headers["x-ratelimit-remaining-requests"] == "7"
    assert 5700 <= int(headers["x-ratelimit-remaining-tokens"]) <= 5700 + backend.refill(6000)
    assert 18.0 - backend.elapsed() <= third.reset_requests_s <= 18.0
    assert headers["x-ratelimit-reset-requests"] == format_duration(third.reset_requests_s)


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


# --- bad inputs and failures ------------------------------------------------------------------------


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


def test_redis_unreachable_raises_unavailable() -> None:
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


def test_in_process_forgets_idle_buckets() -> None:
    clock = FakeClock()
    limiter = InProcessRateLimiter(clock=clock)

    async def scenario() -> None:
        for index in range(1000):
            await limiter.acquire(f"key-{index}", Limits(rpm=1), 0)
        assert len(limiter) == 1000
        clock.now += 60.0
        result = await limiter.acquire("key-0", Limits(rpm=1), 0)
        assert result.allowed  # a forgotten bucket is a full one, as it would have been
        assert len(limiter) == 1

    asyncio.run(scenario())


def test_make_rate_limiter_picks_the_backend() -> None:
    from llmserve.server.serve import make_rate_limiter  # the server's wiring; imports the engine

    async def scenario() -> None:
        local = make_rate_limiter(None)
        shared = make_rate_limiter(REDIS_URL)
        try:
            assert isinstance(local, InProcessRateLimiter)
            assert isinstance(shared, RedisRateLimiter)
        finally:
            await local.close()
            await shared.close()

    asyncio.run(scenario())
