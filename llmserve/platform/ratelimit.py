"""Per-key rate limits: requests per minute (RPM) and tokens per minute (TPM) over a sliding window.

A request counts against its key for 60 s from its admission: it takes 1 request and its reservation
(prompt tokens plus `max_tokens`) at admission, both or neither, and is admitted only if the requests
and tokens counted in the last 60 s leave room for it. So over ANY 60 s window the tokens admitted for
a key never exceed the TPM limit (and requests the RPM limit); a token bucket, which starts full and
refills continuously, lets up to twice the limit through in one rolling minute. `settle` gives back
what the request did not use once it ends. Reserving up front is what keeps concurrent requests from
overshooting TPM.

Admissions are kept in slots of 1/8 s (so memory per key is bounded, not one entry per request); a
slot expires 60 s after the last admission in it, which can only keep a request counted a little
longer, never shorter.

Two backends share the arithmetic here: `InProcessRateLimiter` (one server process) and
`RedisRateLimiter` in `ratelimit_redis` (several replicas sharing one limit), which builds on this
module; `llmserve serve` picks one (`server.platform_options.make_rate_limiter`).
"""

from __future__ import annotations

import math
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from llmserve.errors import LLMServeError

LimitKind = Literal["requests", "tokens"]

WINDOW_S = 60.0
SLOTS_PER_SECOND = 8  # a power of two, so slot boundaries are exact floats
# Float slack when comparing times, so waiting exactly `retry_after_s` always suffices.
TIME_EPSILON = 1e-9


class RateLimiterUnavailable(LLMServeError):
    """The shared rate-limit store (Redis) cannot be reached; the caller decides to fail open or closed.

    `retry_after_s`: when the store will next be tried (the circuit breaker's cool-down), if known.
    """

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


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
    """Tokens counted against `key` at admission, in window slot `slot`; hand it to `RateLimiter.settle`."""

    key: str
    tokens: int
    tpm: int | None
    slot: int | None = None  # None: nothing was counted (an unlimited key)
    settled: bool = False


@dataclass(frozen=True)
class WindowState:
    """What a key's window holds right after a decision, and the times that follow from it."""

    requests: int  # admitted requests still counted
    tokens: int  # tokens still counted
    reset_s: float  # until everything counted has expired
    requests_wait_s: float | None  # until the request fits the RPM limit (None: it fits, or unlimited)
    tokens_wait_s: float | None  # until it fits the TPM limit (None: it fits, unlimited, or never)


@dataclass
class RateLimitResult:
    """The admission decision plus the window state that OpenAI's rate-limit headers report."""

    allowed: bool
    kind: LimitKind | None  # the limit that denied the request
    retry_after_s: float | None  # time until this request would fit; None when allowed or never
    never: bool  # the reservation alone exceeds the TPM limit: no amount of waiting helps
    limit_requests: int | None
    remaining_requests: int | None
    reset_requests_s: float | None  # time until no request is counted any more
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


def slot_of(now: float) -> int:
    """The window slot an admission at `now` (seconds) is counted in."""
    return math.floor(now * SLOTS_PER_SECOND)


def expired(last_admitted: float, now: float) -> bool:
    """Whether a slot whose last admission was at `last_admitted` no longer counts at `now`."""
    return now + TIME_EPSILON >= last_admitted + WINDOW_S


def time_until_expired(last_admitted: float, now: float) -> float:
    return max(0.0, last_admitted + WINDOW_S - now)


def fits(limits: Limits, requests: int, tokens: int, reserve_tokens: int) -> bool:
    """Whether one more request reserving `reserve_tokens` fits with what the window already counts."""
    return (limits.rpm is None or requests + 1 <= limits.rpm) and (
        limits.tpm is None or tokens + reserve_tokens <= limits.tpm
    )


def admitted_unlimited(key: str, reserve_tokens: int) -> RateLimitResult:
    """The result for a key with no limits: admitted without counting anything."""
    result = decide(Limits(), reserve_tokens, True, WindowState(0, 0, 0.0, None, None))
    result.reservation = Reservation(key=key, tokens=reserve_tokens, tpm=None)
    return result


def decide(limits: Limits, reserve_tokens: int, allowed: bool, window: WindowState) -> RateLimitResult:
    """The result for a decision given the window after it (counts of unlimited dimensions ignored).

    Both backends decide atomically with `fits` and report through here, so headers and retry times
    are computed one way.
    """
    rpm, tpm = limits.rpm, limits.tpm
    never = not allowed and tpm is not None and reserve_tokens > tpm
    kind: LimitKind | None = None
    retry_after_s: float | None = None
    if never:
        kind = "tokens"
    elif not allowed:
        kind, retry_after_s = _binding_limit(limits, window)
    return RateLimitResult(
        allowed=allowed,
        kind=kind,
        retry_after_s=retry_after_s,
        never=never,
        limit_requests=rpm,
        remaining_requests=None if rpm is None else max(0, rpm - window.requests),
        reset_requests_s=None if rpm is None else (window.reset_s if window.requests else 0.0),
        limit_tokens=tpm,
        remaining_tokens=None if tpm is None else max(0, tpm - window.tokens),
        reset_tokens_s=None if tpm is None else (window.reset_s if window.tokens else 0.0),
    )


def _binding_limit(limits: Limits, window: WindowState) -> tuple[LimitKind, float]:
    """Which limit denied the request and how long until both have room for it."""
    waits: dict[LimitKind, float] = {}
    if limits.rpm is not None and window.requests_wait_s is not None:
        waits["requests"] = window.requests_wait_s
    if limits.tpm is not None and window.tokens_wait_s is not None:
        waits["tokens"] = window.tokens_wait_s
    if not waits:  # unreachable while the backends decide with `fits`; never crash a request over it
        return ("requests" if limits.rpm is not None else "tokens"), 0.0
    kind = max(waits, key=lambda name: waits[name])
    return kind, waits[kind]


class RateLimiter(ABC):
    """Admits requests against per-key RPM/TPM limits; limits are passed per call, so changes apply at once."""

    @abstractmethod
    async def acquire(self, key: str, limits: Limits, reserve_tokens: int) -> RateLimitResult:
        """Count 1 request and `reserve_tokens` tokens against `key`'s window, both or neither."""

    @abstractmethod
    async def settle(self, reservation: Reservation, used_tokens: int, *, withdrawn: bool = False) -> None:
        """Return the reserved tokens the request did not use (never more than reserved); idempotent.
        `withdrawn`: the request was refused as invalid before it ran, so it no longer counts either."""

    async def check(self) -> None:  # noqa: B027 - a no-op is the right default for local backends
        """Raise `RateLimiterUnavailable` if the backend cannot be reached (for a startup check)."""

    async def close(self) -> None:  # noqa: B027 - nothing to release for local backends
        """Release connections."""


@dataclass
class _Slot:
    index: int
    last_admitted: float
    requests: int = 0
    tokens: int = 0


@dataclass
class _Window:
    """One key's admissions in the last minute, oldest slot first, with running totals."""

    slots: deque[_Slot] = field(default_factory=deque)
    by_index: dict[int, _Slot] = field(default_factory=dict)
    requests: int = 0
    tokens: int = 0

    def expire(self, now: float) -> None:
        while self.slots and expired(self.slots[0].last_admitted, now):
            slot = self.slots.popleft()
            del self.by_index[slot.index]
            self.requests -= slot.requests
            self.tokens -= slot.tokens

    def add(self, now: float, tokens: int) -> _Slot:
        newest = self.slots[-1] if self.slots else None
        if newest is not None and newest.index >= slot_of(now):  # also a clock that stepped back
            slot = newest
        else:
            slot = _Slot(slot_of(now), now)
            self.slots.append(slot)
            self.by_index[slot.index] = slot
        slot.last_admitted = max(slot.last_admitted, now)
        slot.requests += 1
        slot.tokens += tokens
        self.requests += 1
        self.tokens += tokens
        return slot

    def refund(self, index: int, tokens: int, requests: int = 0) -> None:
        """Give back tokens (and requests) counted in slot `index`; an expired slot no longer counts:
        nothing to do."""
        slot = self.by_index.get(index)
        if slot is not None:
            tokens = min(tokens, slot.tokens)
            slot.tokens -= tokens
            self.tokens -= tokens
            requests = min(requests, slot.requests)
            slot.requests -= requests
            self.requests -= requests

    def state(self, limits: Limits, reserve_tokens: int, now: float, denied: bool) -> WindowState:
        reset_s = time_until_expired(self.slots[-1].last_admitted, now) if self.slots else 0.0
        requests_wait = tokens_wait = None
        if denied and limits.rpm is not None and self.requests + 1 > limits.rpm:
            requests_wait = self._wait(self.requests + 1 - limits.rpm, now, by_tokens=False)
        if denied and limits.tpm is not None and self.tokens + reserve_tokens > limits.tpm >= reserve_tokens:
            tokens_wait = self._wait(self.tokens + reserve_tokens - limits.tpm, now, by_tokens=True)
        return WindowState(self.requests, self.tokens, reset_s, requests_wait, tokens_wait)

    def _wait(self, excess: int, now: float, by_tokens: bool) -> float:
        """Until enough of the oldest slots expire to free `excess` (only walked on a denial)."""
        freed = 0
        for slot in self.slots:
            freed += slot.tokens if by_tokens else slot.requests
            if freed >= excess:
                return time_until_expired(slot.last_admitted, now)
        return time_until_expired(self.slots[-1].last_admitted, now)  # unreachable: totals are the sums


class InProcessRateLimiter(RateLimiter):
    """Windows in this process's memory: exact and fast, but each server replica has its own limit."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()  # never held across an await
        self._windows: dict[str, _Window] = {}
        self._last_sweep = clock()

    async def acquire(self, key: str, limits: Limits, reserve_tokens: int) -> RateLimitResult:
        validate_reserve_tokens(reserve_tokens)
        if limits.unlimited:
            return admitted_unlimited(key, reserve_tokens)
        with self._lock:
            now = self._clock()
            self._forget_idle_windows(now)
            window = self._windows.get(key) or _Window()
            window.expire(now)
            allowed = fits(limits, window.requests, window.tokens, reserve_tokens)
            slot = None
            if allowed:
                slot = window.add(now, reserve_tokens)
                self._windows[key] = window
            state = window.state(limits, reserve_tokens, now, denied=not allowed)
        result = decide(limits, reserve_tokens, allowed, state)
        if slot is not None:
            result.reservation = Reservation(key=key, tokens=reserve_tokens, tpm=limits.tpm, slot=slot.index)
        return result

    async def settle(self, reservation: Reservation, used_tokens: int, *, withdrawn: bool = False) -> None:
        validate_used_tokens(used_tokens)
        with self._lock:
            if reservation.settled:
                return
            reservation.settled = True
            window = self._windows.get(reservation.key)
            if window is not None and reservation.slot is not None:
                unused = reservation.tokens - min(used_tokens, reservation.tokens)
                window.refund(reservation.slot, unused, requests=1 if withdrawn else 0)

    def _forget_idle_windows(self, now: float) -> None:
        """Drop windows whose every admission has expired; runs at most once per window length."""
        if now - self._last_sweep < WINDOW_S:
            return
        self._last_sweep = now
        idle = [
            key for key, window in self._windows.items()
            if not window.slots or expired(window.slots[-1].last_admitted, now)
        ]
        for key in idle:
            del self._windows[key]

    def __len__(self) -> int:
        """How many keys' windows are held (bounded by the keys active in the last two minutes)."""
        with self._lock:
            return len(self._windows)
