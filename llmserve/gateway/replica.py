"""The gateway's view of one replica: where it is, whether it may be sent requests, and how busy it is.

Load comes from two sources. The replica's own figures (`running`, `waiting`, KV cache usage: vLLM's
`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`) arrive by a poll
or a report every so often and include every gateway's traffic, but are stale between polls. The
gateway's own count of requests in flight is current but sees only this gateway. The load score joins
them: the last polled figures plus the change in this gateway's in-flight count since that poll, so a
burst sent between two polls spreads instead of landing on the replica that looked idle at the last
poll (a LiteLLM proxy on "least busy" sent all 10 requests of a burst to one replica that way).

Requests waiting for a replica's first byte register a timer here (`waiting_for_answer`); ejecting the
replica fires them at once, so a request stuck on a replica that hung is retried elsewhere as soon as
the health checks give up on it, however long its own first-byte timeout is."""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

WAITING_WEIGHT = 4  # vLLM's router score: a queued request costs four running ones


class ReplicaState(enum.Enum):
    HEALTHY = "healthy"
    DRAINING = "draining"  # shutting down: finishes what it has, gets nothing new
    EJECTED = "ejected"  # failed its health checks; its cache is presumed lost


@dataclass(eq=False)
class Replica:
    """One replica, identified by its base URL. Equality is identity: the gateway keeps one per URL."""

    url: str
    state: ReplicaState = ReplicaState.HEALTHY
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    in_flight: int = 0
    # Bumped on every ejection, so a policy can tell that what it remembered of this replica's cache
    # predates a restart, even if it never saw the replica while it was ejected.
    cache_epoch: int = 0
    source: str | None = None  # the `dns+` pool entry whose name resolved to it; None: listed as it is
    _in_flight_at_report: int = field(default=0, repr=False)
    _waiting: set[asyncio.Timeout] = field(default_factory=set, repr=False)

    @property
    def name(self) -> str:
        return self.url

    @property
    def routable(self) -> bool:
        return self.state is ReplicaState.HEALTHY

    @property
    def load_score(self) -> int:
        """vLLM's `waiting * 4 + running` from the last report, plus the requests this gateway sent
        (minus those it saw finish) since then. Never negative."""
        reported = WAITING_WEIGHT * self.waiting + self.running
        return max(0, reported + self.in_flight - self._in_flight_at_report)

    def report_load(self, *, running: int, waiting: int, kv_cache_usage: float) -> None:
        """Record the replica's own figures (a poll of its /metrics, or a report it pushed)."""
        if running < 0 or waiting < 0:
            raise ValueError(f"running and waiting must be >= 0, got {running} and {waiting}.")
        if not 0.0 <= kv_cache_usage <= 1.0:
            raise ValueError(f"kv_cache_usage must be in [0, 1], got {kv_cache_usage}.")
        self.running, self.waiting, self.kv_cache_usage = running, waiting, kv_cache_usage
        self._in_flight_at_report = self.in_flight

    def request_started(self) -> None:
        self.in_flight += 1

    def request_finished(self) -> None:
        if self.in_flight == 0:
            raise RuntimeError(f"{self.url}: a request finished that was never started.")
        self.in_flight -= 1

    @contextlib.asynccontextmanager
    async def waiting_for_answer(self, timeout_s: float) -> AsyncIterator[None]:
        """Bounds waiting for this replica's answer: TimeoutError after `timeout_s`, or once it is ejected."""
        async with asyncio.timeout(timeout_s) as timer:
            self._waiting.add(timer)
            try:
                yield
            finally:
                self._waiting.discard(timer)

    def eject(self) -> None:
        if self.state is not ReplicaState.EJECTED:
            self.state = ReplicaState.EJECTED
            self.cache_epoch += 1
            now = asyncio.get_running_loop().time() if self._waiting else 0.0
            for timer in self._waiting:
                timer.reschedule(now)

    def drain(self) -> None:
        if self.state is ReplicaState.HEALTHY:
            self.state = ReplicaState.DRAINING

    def readmit(self) -> None:
        """Healthy again. Its polled figures are stale (it may have restarted): zero until the next poll."""
        self.state = ReplicaState.HEALTHY
        self.report_load(running=0, waiting=0, kv_cache_usage=0.0)
