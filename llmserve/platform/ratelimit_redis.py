"""The Redis rate-limit backend: every replica runs the same Lua scripts on one Redis, so they share limits.

A key's sliding window (see `ratelimit`) lives in two Redis keys: the hash `<prefix><key>` with the
totals `r` (requests) and `t` (tokens) and, per slot N, `rN`, `tN` and `xN` (time of the slot's last
admission), and the list `<prefix><key>:slots` of slot numbers, oldest first. Scripts read the clock
with `TIME` on the Redis server, so replicas with skewed clocks agree (tests pass a clock instead). Both
keys expire once everything in them has.

A Redis that is down or hung must not slow every request: replies time out after `timeout_s` (100 ms),
and a circuit breaker stops calling Redis for a cool-down after repeated failures, so requests then
get `RateLimiterUnavailable` at once and the server fails open or closed as configured.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Literal

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from llmserve.platform.ratelimit import (
    SLOTS_PER_SECOND,
    TIME_EPSILON,
    WINDOW_S,
    Limits,
    RateLimiter,
    RateLimiterUnavailable,
    RateLimitResult,
    Reservation,
    WindowState,
    admitted_unlimited,
    decide,
    validate_reserve_tokens,
    validate_used_tokens,
)

logger = logging.getLogger(__name__)

WINDOW_TTL_MS = int((WINDOW_S + 1) * 1000)

# KEYS: the window's hash and slot list. ARGV: rpm, tpm (0 = unlimited), tokens to reserve, now in
# seconds ('' = the Redis server's clock), window seconds, slots per second, TTL ms, epsilon.
# Returns {allowed (1/0), requests, tokens (counted after the decision), slot, reset s, requests wait s,
# tokens wait s} ('' for a wait that does not apply). Mirrors InProcessRateLimiter.acquire.
_ACQUIRE_LUA = """
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local need = tonumber(ARGV[3])
local window = tonumber(ARGV[5])
local per_second = tonumber(ARGV[6])
local ttl_ms = tonumber(ARGV[7])
local epsilon = tonumber(ARGV[8])
local now, slot
if ARGV[4] == '' then
  local clock = redis.call('TIME')
  now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
  slot = tonumber(clock[1]) * per_second + math.floor(tonumber(clock[2]) * per_second / 1000000)
else
  now = tonumber(ARGV[4])
  slot = math.floor(now * per_second)
end
local function seconds(value) return string.format('%.17g', math.max(0, value)) end

local requests = tonumber(redis.call('HGET', KEYS[1], 'r')) or 0
local tokens = tonumber(redis.call('HGET', KEYS[1], 't')) or 0
local changed = false
while true do
  local head = redis.call('LINDEX', KEYS[2], 0)
  if not head then break end
  local last = tonumber(redis.call('HGET', KEYS[1], 'x' .. head))
  if last and now + epsilon < last + window then break end
  local counts = redis.call('HMGET', KEYS[1], 'r' .. head, 't' .. head)
  requests = requests - (tonumber(counts[1]) or 0)
  tokens = tokens - (tonumber(counts[2]) or 0)
  redis.call('HDEL', KEYS[1], 'r' .. head, 't' .. head, 'x' .. head)
  redis.call('LPOP', KEYS[2])
  changed = true
end

local newest = redis.call('LINDEX', KEYS[2], -1)
if newest and tonumber(newest) >= slot then slot = tonumber(newest) end  -- also a clock that stepped back
local id = string.format('%d', slot)
local allowed = (rpm == 0 or requests + 1 <= rpm) and (tpm == 0 or tokens + need <= tpm)
if allowed then
  if newest ~= id then redis.call('RPUSH', KEYS[2], id) end
  redis.call('HINCRBY', KEYS[1], 'r' .. id, 1)
  redis.call('HINCRBY', KEYS[1], 't' .. id, need)
  local last = tonumber(redis.call('HGET', KEYS[1], 'x' .. id))
  if not last or now > last then redis.call('HSET', KEYS[1], 'x' .. id, string.format('%.17g', now)) end
  requests = requests + 1
  tokens = tokens + need
  changed = true
end
if changed then
  redis.call('HSET', KEYS[1], 'r', requests, 't', tokens)
  redis.call('PEXPIRE', KEYS[1], ttl_ms)
  redis.call('PEXPIRE', KEYS[2], ttl_ms)
end

local function wait_to_free(prefix, excess)
  local freed = 0
  for _, head in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do
    local counts = redis.call('HMGET', KEYS[1], prefix .. head, 'x' .. head)
    freed = freed + (tonumber(counts[1]) or 0)
    if freed >= excess then return seconds(tonumber(counts[2]) + window - now) end
  end
  return ''
end
local reset = '0'
local last_slot = redis.call('LINDEX', KEYS[2], -1)
if last_slot then reset = seconds(tonumber(redis.call('HGET', KEYS[1], 'x' .. last_slot)) + window - now) end
local requests_wait, tokens_wait = '', ''
if not allowed and rpm > 0 and requests + 1 > rpm then requests_wait = wait_to_free('r', requests + 1 - rpm) end
if not allowed and tpm > 0 and need <= tpm and tokens + need > tpm then
  tokens_wait = wait_to_free('t', tokens + need - tpm)
end
return {allowed and 1 or 0, requests, tokens, id, reset, requests_wait, tokens_wait}
"""

# KEYS[1]: the window's hash. ARGV: slot, tokens to give back, requests to give back. A slot that
# expired no longer counts, so there is nothing to give back to.
_SETTLE_LUA = """
local held = tonumber(redis.call('HGET', KEYS[1], 't' .. ARGV[1]))
if held == nil then return 0 end
local refund = math.min(held, tonumber(ARGV[2]))
redis.call('HINCRBY', KEYS[1], 't' .. ARGV[1], -refund)
redis.call('HINCRBY', KEYS[1], 't', -refund)
local requests = math.min(tonumber(redis.call('HGET', KEYS[1], 'r' .. ARGV[1])) or 0, tonumber(ARGV[3]))
if requests > 0 then
  redis.call('HINCRBY', KEYS[1], 'r' .. ARGV[1], -requests)
  redis.call('HINCRBY', KEYS[1], 'r', -requests)
end
return 1
"""

BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    """Stops calling a failing dependency: after `failure_threshold` consecutive failures it opens for
    `cooldown_s`; then one probe call goes through (half-open), and its outcome closes or reopens it.

    Logs one line per state change, never one per call.
    """

    def __init__(
        self,
        name: str,
        failure_threshold: int = 3,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self.state: BreakerState = "closed"
        self._failures = 0
        self._opened_at = 0.0
        self._probing = False

    def allow(self) -> bool:
        """Whether to make a call now: always when closed, never while cooling down, one probe after."""
        if self.state == "closed":
            return True
        if self.state == "open":
            if self.retry_after_s() > 0:
                return False
            self._change("half_open", "probing with one call")
        if self._probing:
            return False
        self._probing = True
        return True

    def retry_after_s(self) -> float:
        """Until the next probe may go out (0 when closed or due)."""
        if self.state != "open":
            return 0.0
        return max(0.0, self._opened_at + self.cooldown_s - self._clock())

    def succeeded(self) -> None:
        self._failures = 0
        if self.state != "closed":
            self._change("closed", "calls go through again")

    def failed(self, error: Exception) -> None:
        self._failures += 1
        if self.state == "half_open" or (self.state == "closed" and self._failures >= self.failure_threshold):
            self._opened_at = self._clock()
            self._change(
                "open", f"{self._failures} consecutive failures, not calling for {self.cooldown_s:g} s: {error}"
            )

    def abandoned(self) -> None:
        """A call ended with neither answer nor error (cancelled): a probe may go out again."""
        self._probing = False

    def _change(self, state: BreakerState, why: str) -> None:
        previous, self.state = self.state, state
        self._probing = False
        log = logger.info if state == "half_open" else logger.warning
        log("rate-limit store %s: circuit %s -> %s (%s)", self.name, previous, state, why)


class RedisRateLimiter(RateLimiter):
    """Limits shared by every replica pointing at the same Redis (and prefix).

    Errors reaching Redis, and calls refused by the open circuit breaker, raise `RateLimiterUnavailable`.
    One reconnect is tried per call on a connection error, so a pooled connection that went stale (a
    Redis restart) costs no request; timeouts are not retried. A reply lost after the script ran can
    then apply it twice, which errs towards limiting (acquire) or at worst gives one refund twice.
    """

    def __init__(
        self,
        url: str,
        prefix: str = "llmserve:rl:",
        timeout_s: float = 0.1,
        connect_timeout_s: float = 1.0,
        max_connections: int = 64,
        breaker: CircuitBreaker | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._prefix = prefix
        self._url = url
        self._clock = clock  # None: the Redis server's clock
        self.reply_timeout_s = timeout_s
        self.breaker = breaker or CircuitBreaker(self._safe_url())
        # A blocking pool makes a burst beyond `max_connections` wait its turn (up to
        # `connect_timeout_s`) instead of failing, which redis-py's default pool does. Opening many
        # connections at once on a busy event loop can take longer than a reply; a Redis that accepts
        # connections and never answers is caught by the reply timeout, `timeout_s`.
        pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=connect_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=timeout_s,
            retry=Retry(NoBackoff(), retries=1, supported_errors=(RedisConnectionError,)),
        )
        self._redis = redis.Redis.from_pool(pool)
        self._acquire_script = self._redis.register_script(_ACQUIRE_LUA)
        self._settle_script = self._redis.register_script(_SETTLE_LUA)

    async def acquire(self, key: str, limits: Limits, reserve_tokens: int) -> RateLimitResult:
        validate_reserve_tokens(reserve_tokens)
        if limits.unlimited:
            return admitted_unlimited(key, reserve_tokens)
        now = "" if self._clock is None else repr(self._clock())
        args = [
            limits.rpm or 0, limits.tpm or 0, reserve_tokens, now, WINDOW_S, SLOTS_PER_SECOND,
            WINDOW_TTL_MS, repr(TIME_EPSILON),
        ]
        keys = [self.bucket_key(key), self.bucket_key(key) + ":slots"]
        allowed, requests, tokens, slot, reset, requests_wait, tokens_wait = await self._call(
            self._acquire_script, keys, args
        )
        window = WindowState(int(requests), int(tokens), float(reset), _seconds(requests_wait), _seconds(tokens_wait))
        result = decide(limits, reserve_tokens, allowed == 1, window)
        if result.allowed:
            result.reservation = Reservation(key=key, tokens=reserve_tokens, tpm=limits.tpm, slot=int(slot))
        return result

    async def settle(self, reservation: Reservation, used_tokens: int, *, withdrawn: bool = False) -> None:
        validate_used_tokens(used_tokens)
        if reservation.settled:
            return
        # Marked before the await, so a concurrent second settle is a no-op; if Redis fails, the refund
        # is lost, which only makes the limit stricter for at most a minute.
        reservation.settled = True
        refund = reservation.tokens - min(used_tokens, reservation.tokens)
        if reservation.slot is None or (not withdrawn and (refund == 0 or reservation.tpm is None)):
            return
        await self._call(self._settle_script, [self.bucket_key(reservation.key)],
                         [reservation.slot, refund, 1 if withdrawn else 0])

    async def check(self) -> None:
        try:
            await self._redis.ping()
        except (RedisError, OSError) as error:
            raise self._unavailable(error) from error

    async def close(self) -> None:
        await self._redis.aclose()

    def bucket_key(self, key: str) -> str:
        """The Redis key holding `key`'s window (its slot list is this plus `:slots`)."""
        return self._prefix + key

    async def _call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        if not self.breaker.allow():
            raise RateLimiterUnavailable(
                f"rate-limit store {self._safe_url()} is not called while its circuit is open",
                retry_after_s=self.breaker.retry_after_s(),
            )
        try:
            reply = await script(keys=keys, args=args)
        except (RedisError, OSError) as error:
            self.breaker.failed(error)
            raise self._unavailable(error) from error
        except BaseException:
            self.breaker.abandoned()
            raise
        self.breaker.succeeded()
        return reply

    def _unavailable(self, error: Exception) -> RateLimiterUnavailable:
        return RateLimiterUnavailable(
            f"rate-limit store unreachable at {self._safe_url()}: {error}", retry_after_s=self.breaker.retry_after_s()
        )

    def _safe_url(self) -> str:
        """The URL without credentials, for error messages and logs."""
        scheme, _, rest = self._url.partition("://")
        return f"{scheme}://{rest.rpartition('@')[2]}" if rest else self._url


def _seconds(reply: bytes | str) -> float | None:
    text = reply.decode() if isinstance(reply, bytes) else reply
    return float(text) if text else None
