"""GET /metrics of the gateway: routing decisions by pool and reason, each replica's health and the
requests sent to it, requests retried and streams broken, and prefill/decode disaggregation's outcomes
and prefill calls (Prometheus text, `llmserve:gateway_` names). A pool's prefill replicas show as a pool
of their own, `NAME/prefill`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmserve.gateway.replica import ReplicaState

if TYPE_CHECKING:
    from llmserve.gateway.pool import Pool

# A prefill call computes a prompt and one token: from milliseconds (a short prompt on an idle replica)
# to tens of seconds (a context window's worth, queued).
PREFILL_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


class GatewayMetrics:
    def __init__(self, pools: Iterable[Pool]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(list(pools)))
        self.requests = Counter(
            "llmserve:gateway_requests", "Requests sent to a replica (retries included).",
            ["pool", "replica"], registry=self.registry,
        )
        self.retried = Counter(
            "llmserve:gateway_requests_retried", "Requests sent to another replica after a failure before "
            "any byte reached the client, or after a draining replica refused them.", ["pool"], registry=self.registry,
        )
        self.streams_broken = Counter(
            "llmserve:gateway_streams_broken", "Streams whose replica failed mid-way (ended with an error "
            "event).", ["pool"], registry=self.registry,
        )
        self.ejections = Counter(
            "llmserve:gateway_replica_ejections", "Times a replica was ejected (failed a health check, a "
            "connection, or answered 503).", ["pool", "replica"], registry=self.registry,
        )
        self.disaggregated = Counter(
            "llmserve:gateway_disaggregated_requests", "Chat and completion requests of pools with prefill "
            "replicas, by outcome: transferred (prefilled on a prefill replica, decoded on a decode replica), "
            "prefill_failed (the prefill call failed: decoded whole), no_prefill_replica (none healthy), "
            "skipped_short (prompt under --pd-min-prompt-chars), skipped_cached (the decode replica holds "
            "most of the prompt).", ["pool", "outcome"], registry=self.registry,
        )
        self.prefill_seconds = Histogram(
            "llmserve:gateway_prefill_seconds", "Seconds of the prefill calls that succeeded, from sending "
            "to the prefill replica's answer.", ["pool"], buckets=PREFILL_SECONDS_BUCKETS, registry=self.registry,
        )


class _PoolCollector:
    """Read at scrape time from the pools themselves, so nothing is counted twice."""

    def __init__(self, pools: list[Pool]) -> None:
        self._pools = pools

    def collect(self) -> Iterator[Metric]:
        decisions = CounterMetricFamily(
            "llmserve:gateway_routing_decisions", "Routing decisions by pool and reason.",
            labels=["pool", "reason"],
        )
        healthy = GaugeMetricFamily(
            "llmserve:gateway_replica_healthy", "1 when the replica may be sent requests, else 0 "
            "(ejected or draining).", labels=["pool", "replica"],
        )
        draining = GaugeMetricFamily(
            "llmserve:gateway_replica_draining", "1 while the replica shuts down (finishing what it has, "
            "getting nothing new), else 0.", labels=["pool", "replica"],
        )
        in_flight = GaugeMetricFamily(
            "llmserve:gateway_replica_in_flight", "Requests this gateway has in flight on the replica.",
            labels=["pool", "replica"],
        )
        for pool in self._pools:
            for reason, count in sorted(pool.policy.decisions.items()):
                decisions.add_metric([pool.name, reason], count)
            for replica in pool.replicas:
                healthy.add_metric([pool.name, replica.url], float(replica.state is ReplicaState.HEALTHY))
                draining.add_metric([pool.name, replica.url], float(replica.state is ReplicaState.DRAINING))
                in_flight.add_metric([pool.name, replica.url], replica.in_flight)
        yield from (decisions, healthy, draining, in_flight)
