"""The Redis rate-limit backend: every replica runs the same Lua scripts on one Redis, so they share limits.

A key's buckets live in one hash, `<prefix><key>`, with fields `r` (requests level), `t` (tokens level)
and `ts` (Redis server time the levels refer to); a missing level means a full bucket. Scripts read the
clock with `TIME` on the Redis server, so replicas with skewed clocks agree. The hash expires after
`BUCKET_TTL_MS` idle, by when it would be full again anyway.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from llmserve.platform.ratelimit import (
    FULL_REFILL_S,
    LEVEL_EPSILON,
    Limits,
    RateLimiter,
    RateLimiterUnavailable,
    RateLimitResult,
    Reservation,
    admitted_unlimited,
    decide,
    validate_reserve_tokens,
    validate_used_tokens,
)

BUCKET_TTL_MS = int(2 * FULL_REFILL_S * 1000)

# KEYS[1]: the buckets hash. ARGV: rpm, tpm (0 = unlimited), tokens to reserve, TTL ms, epsilon.
# Returns {allowed (1/0), requests level, tokens level}: levels after the deduction when allowed, the
# refilled levels when denied. Mirrors InProcessRateLimiter.acquire; %.17g keeps doubles exact.
_ACQUIRE_LUA = """
local rpm = tonumber(ARGV[1])
local tpm = tonumber(ARGV[2])
local need = tonumber(ARGV[3])
local ttl_ms = tonumber(ARGV[4])
local epsilon = tonumber(ARGV[5])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local saved = redis.call('HMGET', KEYS[1], 'r', 't', 'ts')
local stamp = tonumber(saved[3]) or now

local function refill(level, capacity)
  level = tonumber(level)
  if level == nil then return capacity end
  return math.min(capacity, level + math.max(0, now - stamp) * capacity / 60)
end

local requests = 0
local tokens = 0
if rpm > 0 then requests = refill(saved[1], rpm) end
if tpm > 0 then tokens = refill(saved[2], tpm) end
local allowed = (rpm == 0 or requests + epsilon >= 1) and (tpm == 0 or tokens + epsilon >= need)

if allowed then
  redis.call('HSET', KEYS[1], 'ts', string.format('%.6f', now))
  if rpm > 0 then
    requests = math.max(0, requests - 1)
    redis.call('HSET', KEYS[1], 'r', string.format('%.17g', requests))
  else
    redis.call('HDEL', KEYS[1], 'r')
  end
  if tpm > 0 then
    tokens = math.max(0, tokens - need)
    redis.call('HSET', KEYS[1], 't', string.format('%.17g', tokens))
  else
    redis.call('HDEL', KEYS[1], 't')
  end
  redis.call('PEXPIRE', KEYS[1], ttl_ms)
end
return {allowed and 1 or 0, string.format('%.17g', requests), string.format('%.17g', tokens)}
"""

# KEYS[1]: the buckets hash. ARGV: tpm, tokens to give back. A missing level is a full bucket (expired,
# or TPM unlimited when last drawn on), so there is nothing to give back to. The timestamp stays put:
# see ratelimit.refund_level for why capping now is exact.
_SETTLE_LUA = """
local level = tonumber(redis.call('HGET', KEYS[1], 't'))
if level == nil then return 0 end
local capacity = tonumber(ARGV[1])
local refund = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 't', string.format('%.17g', math.min(capacity, level + refund)))
return 1
"""


class RedisRateLimiter(RateLimiter):
    """Limits shared by every replica pointing at the same Redis (and prefix).

    Errors reaching Redis raise `RateLimiterUnavailable`. One reconnect is tried per call, so a pooled
    connection that went stale (a Redis restart) costs no request; a reply lost after the script ran
    can then apply it twice, which errs towards limiting (acquire) or at worst gives one refund twice.
    """

    def __init__(
        self, url: str, prefix: str = "llmserve:rl:", timeout_s: float = 1.0, max_connections: int = 64
    ) -> None:
        self._prefix = prefix
        self._url = url
        # A blocking pool makes a burst beyond `max_connections` wait its turn (up to `timeout_s`)
        # instead of failing, which redis-py's default pool does.
        pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            socket_timeout=timeout_s,
            retry=Retry(NoBackoff(), retries=1),
        )
        self._redis = redis.Redis.from_pool(pool)
        self._acquire_script = self._redis.register_script(_ACQUIRE_LUA)
        self._settle_script = self._redis.register_script(_SETTLE_LUA)

    async def acquire(self, key: str, limits: Limits, reserve_tokens: int) -> RateLimitResult:
        validate_reserve_tokens(reserve_tokens)
        if limits.unlimited:
            return admitted_unlimited(key, reserve_tokens)
        args = [limits.rpm or 0, limits.tpm or 0, reserve_tokens, BUCKET_TTL_MS, repr(LEVEL_EPSILON)]
        allowed, requests, tokens = await self._call(self._acquire_script, key, args)
        result = decide(limits, reserve_tokens, allowed == 1, float(requests), float(tokens))
        if result.allowed:
            result.reservation = Reservation(key=key, tokens=reserve_tokens, tpm=limits.tpm)
        return result

    async def settle(self, reservation: Reservation, used_tokens: int) -> None:
        validate_used_tokens(used_tokens)
        if reservation.settled:
            return
        # Marked before the await, so a concurrent second settle is a no-op; if Redis fails, the refund
        # is lost, which only makes the limit stricter for at most a minute.
        reservation.settled = True
        refund = reservation.tokens - min(used_tokens, reservation.tokens)
        if refund == 0 or reservation.tpm is None:
            return
        await self._call(self._settle_script, reservation.key, [reservation.tpm, refund])

    async def check(self) -> None:
        try:
            await self._redis.ping()
        except (RedisError, OSError) as error:
            raise self._unavailable(error) from error

    async def close(self) -> None:
        await self._redis.aclose()

    def bucket_key(self, key: str) -> str:
        """The Redis key holding `key`'s buckets."""
        return self._prefix + key

    async def _call(self, script: Any, key: str, args: list[Any]) -> Any:
        try:
            return await script(keys=[self.bucket_key(key)], args=args)
        except (RedisError, OSError) as error:
            raise self._unavailable(error) from error

    def _unavailable(self, error: Exception) -> RateLimiterUnavailable:
        return RateLimiterUnavailable(f"rate-limit store unreachable at {self._safe_url()}: {error}")

    def _safe_url(self) -> str:
        """The URL without credentials, for error messages and logs."""
        scheme, _, rest = self._url.partition("://")
        return f"{scheme}://{rest.rpartition('@')[2]}" if rest else self._url
