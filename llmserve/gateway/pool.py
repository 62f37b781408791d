"""A pool: the replicas that serve one model, the routing policy that picks among them, and their health.

Health is watched two ways. Actively, each replica's `/health` is polled every `interval_s` with a
short timeout, and its `/metrics` read for vLLM's load gauges (`report_load`); a refused connection or
a non-200 answer ejects it at once, a timeout after `timeouts_to_eject` in a row (a busy replica may be
slow to answer once), so a hung replica is out within interval + 2 timeouts (2 s with the defaults).
Passively, the proxy ejects a replica the moment a request to it fails to connect, times out or gets a
503. An ejected replica is re-admitted when its `/health` answers 200 again.

A replica shutting down (SIGTERM) answers every new request, /health included, with a 503 whose code
is `shutting_down` while its in-flight requests finish: that replica is draining, not failing. It gets
nothing new from then on (a request refused so goes to another replica at once, no retry spent), and
when it stops answering it leaves quietly (no ejection counted). Ejecting and draining both show in
`state`; a replica that answers 200 again (restarted at the same address) is re-admitted.

Replicas come from the pool's entries: `http://host:port` is one replica; `dns+http://name:port`
stands for every address the name resolves to (a Kubernetes headless Service: one per ready pod), kept
current by `discovery.Discovery`, which adds and removes them here."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from llmserve.gateway.client import REPLICA_ERRORS, ReplicaClient
from llmserve.gateway.prefix_index import PromptKey
from llmserve.gateway.replica import Replica, ReplicaState
from llmserve.gateway.routing import Route, RoutingPolicy

logger = logging.getLogger(__name__)

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
DNS_SCHEME = "dns+"
DRAINING_CODE = "shutting_down"  # the error code of a replica's 503s once it drains (server/errors.py)


def is_draining_answer(status_code: int, body: bytes) -> bool:
    """Whether a replica's answer says it is draining: a 503 whose error code is `shutting_down`."""
    if status_code != 503:
        return False
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == DRAINING_CODE


@dataclass(eq=False)
class Pool:
    """One model's replicas. They start ejected: a replica is sent requests once its health is known."""

    name: str
    replicas: list[Replica]
    policy: RoutingPolicy
    dns_entries: list[str] = field(default_factory=list)  # `dns+http://name:port`, resolved by discovery
    on_eject: Callable[[Pool, Replica], None] | None = field(default=None, repr=False)
    on_change: Callable[[Pool], None] | None = field(default=None, repr=False)  # a replica came or went

    @classmethod
    def of(cls, name: str, urls: Sequence[str], policy: RoutingPolicy) -> Pool:
        replicas = [Replica(url.rstrip("/"), state=ReplicaState.EJECTED)
                    for url in urls if not url.startswith(DNS_SCHEME)]
        return cls(name, replicas, policy, [url.rstrip("/") for url in urls if url.startswith(DNS_SCHEME)])

    def add(self, url: str, source: str | None = None) -> Replica | None:
        """A new replica (ejected until its health is known), or None if the pool has that URL already."""
        if any(replica.url == url for replica in self.replicas):
            return None
        replica = Replica(url, state=ReplicaState.EJECTED, source=source)
        self.replicas.append(replica)
        logger.warning("gateway: %s joins pool %s", url, self.name)
        self._changed()
        return replica

    def remove(self, replica: Replica) -> None:
        """The replica leaves the pool; requests it is serving finish, it gets no new ones."""
        self.replicas.remove(replica)
        replica.drain()
        self.policy.on_eject(replica)
        logger.warning("gateway: %s leaves pool %s", replica.url, self.name)
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)

    def choose(self, prompt: PromptKey, excluded: Sequence[Replica] = (), cache_key: str | None = None) -> Replica:
        """A routable replica for the prompt (and its `prompt_cache_key`), never one of `excluded` (raises
        `NoReplicaAvailable`)."""
        return self.route(prompt, excluded, cache_key).replica

    def route(self, prompt: PromptKey, excluded: Sequence[Replica] = (), cache_key: str | None = None) -> Route:
        """`choose`, with the reason and what the replica was remembered to hold of the prompt."""
        candidates = [replica for replica in self.replicas if replica not in excluded]
        return self.policy.route(prompt, candidates, cache_key)

    def eject(self, replica: Replica, reason: str) -> None:
        """Out of routing until healthy again. A draining replica that stops answering has just finished
        shutting down: it leaves quietly, no ejection counted."""
        if replica.state is ReplicaState.EJECTED:
            return
        drained = replica.state is ReplicaState.DRAINING
        if drained:
            logger.info("gateway: %s (pool %s) is gone after draining: %s", replica.url, self.name, reason)
        else:
            logger.warning("gateway: ejecting %s from pool %s: %s", replica.url, self.name, reason)
        replica.eject()
        self.policy.on_eject(replica)
        if self.on_eject is not None and not drained:
            self.on_eject(self, replica)

    def drain(self, replica: Replica) -> None:
        """The replica is shutting down: nothing new goes to it; what it serves finishes."""
        if replica.state is ReplicaState.HEALTHY:
            logger.warning("gateway: %s (pool %s) is draining", replica.url, self.name)
            replica.drain()

    def readmit(self, replica: Replica) -> None:
        if replica.state is not ReplicaState.HEALTHY:
            logger.warning("gateway: %s (pool %s) is healthy again", replica.url, self.name)
            replica.readmit()


def parse_load(metrics_text: str) -> tuple[int, int, float]:
    """Running and waiting requests (summed over the replica's models) and its highest KV cache usage."""
    running = waiting = 0
    usage = 0.0
    for family in text_string_to_metric_families(metrics_text):
        values = [sample.value for sample in family.samples]
        if family.name == RUNNING:
            running = int(sum(values))
        elif family.name == WAITING:
            waiting = int(sum(values))
        elif family.name == KV_USAGE:
            usage = min(1.0, max(values, default=0.0))
    return max(0, running), max(0, waiting), max(0.0, usage)


class HealthChecker:
    """Polls every replica of every pool, each on its own task, until stopped; `sync` starts polling
    replicas that joined and stops polling those that left."""

    def __init__(
        self, pools: Sequence[Pool], client: ReplicaClient, *, interval_s: float = 0.5,
        timeout_s: float = 0.5, timeouts_to_eject: int = 2,
    ) -> None:
        self.pools = list(pools)
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.timeouts_to_eject = timeouts_to_eject
        self._timeouts: dict[Replica, int] = {}
        self._tasks: dict[Replica, asyncio.Task] = {}
        self._running = False

    async def check_all(self) -> None:
        """One round over every replica (at start, so the pools' health is known before any request)."""
        await asyncio.gather(*(self.check(pool, replica) for pool in self.pools for replica in pool.replicas))

    def start(self) -> None:
        self._running = True
        self.sync()

    def sync(self) -> None:
        """One polling task per replica in the pools now."""
        if not self._running:
            return
        current = {replica: pool for pool in self.pools for replica in pool.replicas}
        for replica in [replica for replica in self._tasks if replica not in current]:
            self._tasks.pop(replica).cancel()
            self._timeouts.pop(replica, None)
        for replica, pool in current.items():
            if replica not in self._tasks:
                self._tasks[replica] = asyncio.create_task(self._poll(pool, replica))

    async def stop(self) -> None:
        self._running = False
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = {}

    async def _poll(self, pool: Pool, replica: Replica) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.check(pool, replica)
            except Exception:  # a bug here must not stop the polling of this replica
                logger.exception("gateway: health check of %s failed", replica.url)
            await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))

    async def check(self, pool: Pool, replica: Replica) -> None:
        try:
            status, body = await self._get(f"{replica.url}/health")
        except TimeoutError:
            self._timeouts[replica] = self._timeouts.get(replica, 0) + 1
            if self._timeouts[replica] >= self.timeouts_to_eject:
                pool.eject(replica, f"/health timed out {self._timeouts[replica]} times in a row")
            return
        except REPLICA_ERRORS as exc:
            pool.eject(replica, f"/health: {type(exc).__name__}: {exc}")
            return
        self._timeouts[replica] = 0
        if is_draining_answer(status, body):
            pool.drain(replica)
            return
        if status != 200:
            pool.eject(replica, f"/health answered {status}")
            return
        pool.readmit(replica)
        await self._read_load(replica)

    async def _read_load(self, replica: Replica) -> None:
        try:
            status, body = await self._get(f"{replica.url}/metrics")
        except (TimeoutError, *REPLICA_ERRORS):
            return  # healthy but slow to report: keep the last figures
        if status == 200:
            running, waiting, usage = parse_load(body.decode(errors="replace"))
            replica.report_load(running=running, waiting=waiting, kv_cache_usage=usage)

    async def _get(self, url: str) -> tuple[int, bytes]:
        """A GET's status and body, the whole exchange bounded by the check's timeout (TimeoutError)."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with self.client.session.get(url, timeout=timeout) as response:
            return response.status, await response.read()
