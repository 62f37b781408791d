"""GET /metrics: Prometheus text with vLLM's metric names, labelled with the served model's name.

The values are read at scrape time from the engine's latest published stats, so the engine loop does
no metric work at all.
"""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmserve.engine.async_llm import AsyncLLM

router = APIRouter()


class EngineCollector(Collector):
    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def _gauge(self, name: str, documentation: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, documentation, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def _counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, documentation, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.last_stats
        yield self._gauge(
            "vllm:num_requests_running", "Number of requests in the running batch.", stats.num_running
        )
        yield self._gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be scheduled.",
            self.engine.num_waiting,
        )
        yield self._gauge(
            "vllm:kv_cache_usage_perc", "KV cache usage (1 means 100 percent).", stats.kv_cache_usage
        )
        yield self._gauge("llmserve:num_kv_blocks_used", "KV cache blocks in use.", stats.num_used_blocks)
        yield self._counter(
            "vllm:num_preemptions", "Cumulative number of preemptions.", stats.num_preemptions
        )
        yield self._counter(
            "llmserve:requests_finished", "Requests that ran to completion.", self.engine.num_finished
        )
        yield self._counter(
            "llmserve:requests_aborted", "Requests aborted (client gone).", self.engine.num_aborted
        )


def make_registry(engine: AsyncLLM, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    return registry


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry: CollectorRegistry = request.app.state.metrics_registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
