"""Per-key rate limits: token buckets for requests per minute (RPM) and tokens per minute (TPM).

Each limited dimension is a bucket holding at most one minute's allowance, refilled continuously at
limit/60 per second. A request takes 1 from the RPM bucket and its reservation (prompt tokens plus
`max_tokens`) from the TPM bucket, both or neither, at admission; `settle` gives back what the request
did not use once it ends. Reserving up front is what keeps concurrent requests from overshooting TPM.

Two backends share the arithmetic here: `InProcessRateLimiter` (one server process) and
`RedisRateLimiter` in `ratelimit_redis` (several replicas sharing one limit), which builds on this
module; `llmserve serve` picks one (`server.serve.make_rate_limiter`).
"""

from __future__ import annotations

import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from llmserve.errors import LLMServeError

LimitKind = Literal["requests", "tokens"]

SECONDS_PER_MINUTE = 60.0
# A bucket left alone this long is full again, so forgetting it changes nothing.
FULL_REFILL_S = SECONDS_PER_MINUTE
# Float slack when comparing bucket levels, so waiting exactly `retry_after_s` always suffices.
LEVEL_EPSILON = 1e-9


class RateLimiterUnavailable(LLMServeError):
    """The shared rate-limit store (Redis) cannot be reached; the caller decides to fail open or closed.

    Recommended: fail open (admit, log a warning, count it in a metric, send no rate-limit headers), so
    an outage of the limiter's store does not take serving down with it. Fail closed (503) only where
    the limits guard spend or abuse rather than fairness.
    """


@dataclass(frozen=True)
class Limits:
    """A key's limits per minute; None means unlimited in that dimension."""

    rpm: int | None = None
    tpm: int | None = None

    @property
    def unlimited(self) -> bool:
        return self.rpm is None and self.tpm is None

    def __post_init__(self) -> None:
        for name in ("rpm", "tpm"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}.")


@dataclass(eq=False)
class Reservation:
    """Tokens taken from `key`'s TPM bucket at admission; hand it to `RateLimiter.settle` when done."""

    key: str
    tokens: int
    tpm: int | None
    settled: bool = False


@dataclass
class RateLimitResult:
    """The admission decision plus the bucket state that OpenAI's rate-limit headers report."""

    allowed: bool
    kind: LimitKind | None  # the limit that denied the request
    retry_after_s: float | None  # time until this request would fit; None when allowed or never
    never: bool  # the reservation alone exceeds the TPM limit: no amount of waiting helps
    limit_requests: int | None
    remaining_requests: int | None
    reset_requests_s: float | None  # time until the RPM bucket is full again
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_tokens_s: float | None
    reservation: Reservation | None = None

    @property
    def message(self) -> str | None:
        """A client-facing explanation of a denial, OpenAI-style."""
        if self.allowed:
            return None
        if self.never:
            return (
                f"Request too large: it reserves more tokens (prompt plus max_tokens) than the limit of "
                f"{self.limit_tokens} tokens per minute allows. Reduce the prompt or max_tokens."
            )
        limit = self.limit_requests if self.kind == "requests" else self.limit_tokens
        return (
            f"Rate limit reached: limit {limit} {self.kind} per minute. "
            f"Please try again in {format_duration(self.retry_after_s or 0.0)}."
        )

    def headers(self) -> dict[str, str]:
        """OpenAI's `x-ratelimit-*` headers (unlimited dimensions omitted), plus `retry-after*` on denial."""
        headers: dict[str, str] = {}
        for kind, limit, remaining, reset in (
            ("requests", self.limit_requests, self.remaining_requests, self.reset_requests_s),
            ("tokens", self.limit_tokens, self.remaining_tokens, self.reset_tokens_s),
        ):
            if limit is None:
                continue
            headers[f"x-ratelimit-limit-{kind}"] = str(limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(remaining)
            headers[f"x-ratelimit-reset-{kind}"] = format_duration(reset or 0.0)
        if not self.allowed and self.retry_after_s is not None:
            headers["retry-after"] = str(max(1, math.ceil(round(self.retry_after_s, 6))))
            headers["retry-after-ms"] = str(max(1, _whole_milliseconds(self.retry_after_s)))
        return headers


def _whole_milliseconds(seconds: float) -> int:
    # Round up, so a client that waits the advertised time has its budget back; the inner round
    # keeps float noise (18.000000000000004 s) from adding a millisecond.
    return math.ceil(round(seconds * 1000.0, 6))


def format_duration(seconds: float) -> str:
    """A duration the way OpenAI's reset headers write it: `20ms`, `1s`, `1.5s`, `6m0s`, `1h2m3.25s`."""
    if seconds < 0 or math.isnan(seconds):
        raise ValueError(f"duration must be non-negative, got {seconds!r}.")
    total_ms = _whole_milliseconds(seconds)
    if total_ms == 0:
        return "0s"
    if total_ms < 1000:
        return f"{total_ms}ms"
    hours, rest_ms = divmod(total_ms, 3_600_000)
    minutes, rest_ms = divmod(rest_ms, 60_000)
    whole_seconds, millis = divmod(rest_ms, 1000)
    text = f"{whole_seconds}.{millis:03d}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    if minutes:
        return f"{minutes}m{text}"
    return text


def validate_reserve_tokens(reserve_tokens: int) -> None:
    if isinstance(reserve_tokens, bool) or not isinstance(reserve_tokens, int) or reserve_tokens < 0:
        raise ValueError(f"reserve_tokens must be a non-negative integer, got {reserve_tokens!r}.")


def validate_used_tokens(used_tokens: int) -> None:
    if isinstance(used_tokens, bool) or not isinstance(used_tokens, int) or used_tokens < 0:
        raise ValueError(f"used_tokens must be a non-negative integer, got {used_tokens!r}.")


def refill(level: float | None, elapsed_s: float, capacity: int) -> float:
    """The bucket's level `elapsed_s` after it was `level` (None: never touched, so full)."""
    if level is None:
        return float(capacity)
    return min(float(capacity), level + max(0.0, elapsed_s) * capacity / SECONDS_PER_MINUTE)


def fits(level: float, needed: float) -> bool:
    return level + LEVEL_EPSILON >= needed


def refund_level(level: float, refund: int, capacity: int) -> float:
    """The level after giving back `refund` tokens, without moving the bucket's timestamp.

    Capping here and capping again at the next refill gives the same level as refilling first, since
    min(c, min(c, x) + y) == min(c, x + y) for y >= 0; so a refund needs no clock.
    """
    return min(float(capacity), level + refund)


def admitted_unlimited(key: str, reserve_tokens: int) -> RateLimitResult:
    """The result for a key with no limits: admitted without touching any bucket."""
    result = decide(Limits(), reserve_tokens, True, 0.0, 0.0)
    result.reservation = Reservation(key=key, tokens=reserve_tokens, tpm=None)
    return result


def decide(
    limits: Limits, reserve_tokens: int, allowed: bool, requests: float, tokens: float
) -> RateLimitResult:
    """The result for a decision given the bucket levels after it (levels of unlimited dimensions ignored).

    Both backends make the admission decision atomically with `fits` and report it through here, so
    the headers and retry times are computed one way.
    """
    rpm, tpm = limits.rpm, limits.tpm
    never = not allowed and tpm is not None and reserve_tokens > tpm
    kind: LimitKind | None = None
    retry_after_s: float | None = None
    if never:
        kind = "tokens"
    elif not allowed:
        kind, retry_after_s = _binding_limit(limits, reserve_tokens, requests, tokens)
    return RateLimitResult(
        allowed=allowed,
        kind=kind,
        retry_after_s=retry_after_s,
        never=never,
        limit_requests=rpm,
        remaining_requests=None if rpm is None else _whole_units(requests),
        reset_requests_s=None if rpm is None else _time_to_fill(requests, rpm, rpm),
        limit_tokens=tpm,
        remaining_tokens=None if tpm is None else _whole_units(tokens),
        reset_tokens_s=None if tpm is None else _time_to_fill(tokens, tpm, tpm),
    )


def _binding_limit(
    limits: Limits, reserve_tokens: int, requests: float, tokens: float
) -> tuple[LimitKind, float]:
    """Which limit denied the request and how long until both have room for it."""
    waits: dict[LimitKind, float] = {}
    if limits.rpm is not None and not fits(requests, 1):
        waits["requests"] = _time_to_fill(requests, 1, limits.rpm)
    if limits.tpm is not None and not fits(tokens, reserve_tokens):
        waits["tokens"] = _time_to_fill(tokens, reserve_tokens, limits.tpm)
    if not waits:  # unreachable while the backends decide with `fits`; never crash a request over it
        return ("requests" if limits.rpm is not None else "tokens"), 0.0
    kind = max(waits, key=lambda name: waits[name])
    return kind, waits[kind]


def _time_to_fill(level: float, target: float, per_minute: int) -> float:
    return max(0.0, target - level) * SECONDS_PER_MINUTE / per_minute


def _whole_units(level: float) -> int:
    return math.floor(level + LEVEL_EPSILON)


class RateLimiter(ABC):
    """Admits requests against per-key RPM/TPM limits; limits are passed per call, so changes apply at once."""

    @abstractmethod
    async def acquire(self, key: str, limits: Limits, reserve_tokens: int) -> RateLimitResult:
        """Take 1 request and `reserve_tokens` tokens from `key`'s buckets, both or neither."""

    @abstractmethod
    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        """Return the reserved tokens the request did not use (never more than reserved); idempotent."""

    async def check(self) -> None:  # noqa: B027 - a no-op is the right default for local backends
        """Raise `RateLimiterUnavailable` if the backend cannot be reached (for a startup check)."""

    async def close(self) -> None:  # noqa: B027 - nothing to release for local backends
        """Release connections."""


@dataclass
class _Buckets:
    requests: float | None  # None: full (never drawn on, or unlimited when last seen)
    tokens: float | None
    stamp: float  # clock time the levels refer to


class InProcessRateLimiter(RateLimiter):
    """Buckets in this process's memory: exact and fast, but each server replica has its own limit."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()  # never held across an await
        self._buckets: dict[str, _Buckets] = {}
        self._last_sweep = clock()

    async def acquire(self, key: str, limits: Limits, reserve_tokens: int) -> RateLimitResult:
        validate_reserve_tokens(reserve_tokens)
        if limits.unlimited:
            return admitted_unlimited(key, reserve_tokens)
        with self._lock:
            now = self._clock()
            self._forget_full_buckets(now)
            saved = self._buckets.get(key)
            requests, tokens = self._levels_now(saved, limits, now)
            allowed = (limits.rpm is None or fits(requests, 1)) and (
                limits.tpm is None or fits(tokens, reserve_tokens)
            )
            if allowed:
                requests = max(0.0, requests - 1) if limits.rpm is not None else requests
                tokens = max(0.0, tokens - reserve_tokens) if limits.tpm is not None else tokens
                self._buckets[key] = _Buckets(
                    requests=requests if limits.rpm is not None else None,
                    tokens=tokens if limits.tpm is not None else None,
                    stamp=now,
                )
        result = decide(limits, reserve_tokens, allowed, requests, tokens)
        if allowed:
            result.reservation = Reservation(key=key, tokens=reserve_tokens, tpm=limits.tpm)
        return result

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        validate_used_tokens(used_tokens)
        with self._lock:
            if reservation.settled:
                return
            reservation.settled = True
            refund = reservation.tokens - min(used_tokens, reservation.tokens)
            saved = self._buckets.get(reservation.key)
            # A forgotten bucket, or one with no TPM level, is full: nothing to give back to.
            if refund == 0 or reservation.tpm is None or saved is None or saved.tokens is None:
                return
            saved.tokens = refund_level(saved.tokens, refund, reservation.tpm)

    @staticmethod
    def _levels_now(saved: _Buckets | None, limits: Limits, now: float) -> tuple[float, float]:
        elapsed = 0.0 if saved is None else now - saved.stamp
        requests = refill(None if saved is None else saved.requests, elapsed, limits.rpm or 0)
        tokens = refill(None if saved is None else saved.tokens, elapsed, limits.tpm or 0)
        return requests, tokens

    def _forget_full_buckets(self, now: float) -> None:
        """Drop buckets idle long enough to be full again; runs at most once per refill period."""
        if now - self._last_sweep < FULL_REFILL_S:
            return
        self._last_sweep = now
        idle = [key for key, saved in self._buckets.items() if now - saved.stamp >= FULL_REFILL_S]
        for key in idle:
            del self._buckets[key]

    def __len__(self) -> int:
        """How many keys' buckets are held (bounded by the keys active in the last two minutes)."""
        with self._lock:
            return len(self._buckets)
