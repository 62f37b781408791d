"""GET /metrics: Prometheus text with vLLM's metric names and `model_name` label, so dashboards and
routers that scrape vLLM work unchanged, plus `llmserve:` metrics where vLLM has none.

Gauges and the engine's own counters are read at scrape time from the stats the engine thread
publishes. Per-request histograms and token counters come from `Telemetry`: the engine thread only
puts each round's events (timestamps recorded by the engine) on a queue; they are turned into
observations here, on the server's side, when /metrics is scraped, when a request is admitted, and
periodically (so the queue stays short when nobody scrapes).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmserve.server.slo import SLO, LoadEstimator

if TYPE_CHECKING:  # the gateway uses PlatformMetrics without an engine (nor torch)
    from llmserve.engine.async_llm import AsyncLLM, EngineEvents
    from llmserve.engine.messages import EngineStats, StepRecord
    from llmserve.outputs import RequestOutput


class ServedModel(Protocol):
    """What the metrics read of a served model (the server's `ModelEndpoint`)."""

    name: str
    engine: AsyncLLM
    telemetry: Telemetry | None

router = APIRouter()

LABELS = ["model_name"]
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                         7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class EngineCollector(Collector):
    """Scrape-time values from each ready engine's published stats, one sample per model."""

    def __init__(self, endpoints: Callable[[], list[ServedModel]]) -> None:
        self.endpoints = endpoints

    def collect(self) -> Iterator[Metric]:
        endpoints = self.endpoints()

        def family(kind: type, name: str, documentation: str, value: Callable[[ServedModel], float]) -> Metric:
            metric = kind(name, documentation, labels=LABELS)
            for endpoint in endpoints:
                metric.add_metric([endpoint.name], value(endpoint))
            return metric

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield family(gauge, "vllm:num_requests_running", "Number of requests in the running batch.",
                     lambda e: e.engine.last_stats.num_running)
        yield family(gauge, "vllm:num_requests_waiting", "Number of requests waiting to be scheduled.",
                     lambda e: e.engine.num_waiting)
        yield family(gauge, "vllm:kv_cache_usage_perc", "KV cache usage (1 means 100 percent).",
                     lambda e: e.engine.last_stats.kv_cache_usage)
        yield family(gauge, "llmserve:num_kv_blocks_used", "KV cache blocks in use.",
                     lambda e: e.engine.last_stats.num_used_blocks)
        yield family(gauge, "llmserve:num_kv_blocks_cached", "KV cache blocks in the prefix cache.",
                     lambda e: e.engine.last_stats.num_cached_blocks)
        yield family(counter, "vllm:num_preemptions", "Cumulative number of preemptions.",
                     lambda e: e.engine.last_stats.num_preemptions)
        yield family(counter, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     lambda e: e.engine.last_stats.prefix_cache_queries)
        yield family(counter, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                     lambda e: e.engine.last_stats.prefix_cache_hits)
        yield family(counter, "llmserve:requests_finished", "Requests that ran to completion.",
                     lambda e: e.engine.num_finished)
        yield family(counter, "llmserve:requests_aborted", "Requests aborted (client gone).",
                     lambda e: e.engine.num_aborted)
        yield family(counter, "llmserve:engine_core_restarts", "Engine core processes started after one died.",
                     lambda e: e.engine.num_restarts)
        yield family(gauge, "llmserve:engine_core_up", "1 while the engine core process serves, else 0.",
                     lambda e: int(e.engine.is_healthy))
        yield _lora_info(endpoints)
        yield from _spec_decode(endpoints)
        yield from _kv_transfer([e for e in endpoints if e.engine.config.kv_transfer])
        yield from _kv_offload([e for e in endpoints if e.engine.config.kv_offload_gib])


def _kv_offload(endpoints: list[ServedModel]) -> Iterator[Metric]:
    """The prefix cache's second tier, for the engines that have one: blocks saved to it and loaded back, and
    what it holds."""
    yield _each_way("llmserve:kv_offload_blocks", "KV blocks saved to the prefix cache's second tier (evicted from "
                    "the pool) or loaded back from it.", endpoints,
                    {"saved": lambda s: s.kv_offload_saved, "loaded": lambda s: s.kv_offload_loaded})
    yield _per_engine(GaugeMetricFamily, "llmserve:kv_offload_stored_blocks", "KV blocks in the second tier.",
                      endpoints, lambda s: s.kv_offload_blocks)
    yield _per_engine(GaugeMetricFamily, "llmserve:kv_offload_stored_bytes", "Bytes of KV in the second tier.",
                      endpoints, lambda s: s.kv_offload_bytes)


def _kv_transfer(endpoints: list[ServedModel]) -> Iterator[Metric]:
    """Disaggregation, for the engines that transfer KV: blocks sent and received, pulls that failed (the
    request computed its prompt here), held KV nobody pulled in time, and the blocks held now."""
    yield _each_way("llmserve:kv_transfer_blocks", "KV blocks sent to or received from other replicas "
                    "(prefill/decode disaggregation).", endpoints,
                    {"sent": lambda s: s.kv_blocks_sent, "received": lambda s: s.kv_blocks_received})
    yield _per_engine(CounterMetricFamily, "llmserve:kv_transfer_pulls_failed", "KV pulls that failed (the prompt "
                      "was computed here instead).", endpoints, lambda s: s.kv_pulls_failed)
    yield _per_engine(CounterMetricFamily, "llmserve:kv_transfer_exports_expired", "Held KV that no replica pulled "
                      "in time.", endpoints, lambda s: s.kv_exports_expired)
    yield _per_engine(GaugeMetricFamily, "llmserve:kv_transfer_blocks_held", "KV blocks held for other replicas to "
                      "pull.", endpoints, lambda s: s.kv_blocks_held)


def _per_engine(kind: type, name: str, documentation: str, endpoints: list[ServedModel],
                value: Callable[[EngineStats], float]) -> Metric:
    metric = kind(name, documentation, labels=LABELS)
    for endpoint in endpoints:
        metric.add_metric([endpoint.name], value(endpoint.engine.last_stats))
    return metric


def _each_way(name: str, documentation: str, endpoints: list[ServedModel],
              directions: dict[str, Callable[[EngineStats], float]]) -> Metric:
    """A counter per engine and direction (sent/received, saved/loaded)."""
    metric = CounterMetricFamily(name, documentation, labels=[*LABELS, "direction"])
    for endpoint in endpoints:
        for direction, value in directions.items():
            metric.add_metric([endpoint.name, direction], value(endpoint.engine.last_stats))
    return metric


def _spec_decode(endpoints: list[ServedModel]) -> Iterator[Metric]:
    """vLLM's speculative decoding counters, for the engines that speculate: drafts verified, draft tokens,
    tokens accepted, and the tokens accepted at each position of a draft."""
    speculating = [(e.name, e.engine.last_stats.spec_decode) for e in endpoints if e.engine.last_stats.spec_decode]
    for name, documentation, value in (
        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", lambda s: s.num_drafts),
        ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", lambda s: s.num_draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", lambda s: s.num_accepted_tokens),
    ):
        metric = CounterMetricFamily(name, documentation, labels=LABELS)
        for model, stats in speculating:
            metric.add_metric([model], value(stats))
        yield metric
    per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                       "Accepted tokens per draft position.", labels=[*LABELS, "position"])
    for model, stats in speculating:
        for position, count in enumerate(stats.accepted_per_position):
            per_position.add_metric([model, str(position)], count)
    yield per_position


def _lora_info(endpoints: list[ServedModel]) -> Metric:
    """vLLM's: per engine serving LoRA adapters, the adapters running and waiting (by name, comma-separated) and
    how many one step may use, valued at the scrape time."""
    metric = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                               labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
    for endpoint in endpoints:
        config, stats = endpoint.engine.config, endpoint.engine.last_stats
        if config.lora_enabled:
            metric.add_metric([",".join(stats.running_loras), ",".join(stats.waiting_loras), str(config.max_loras)],
                              time.time())
    return metric


class PlatformMetrics:
    """The platform's own counters (no model label where the model may not be known yet), in the
    registry of whoever runs the platform: `llmserve serve` or `llmserve gateway`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

        def counter(name: str, doc: str, labels: list[str]) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        self.auth_failures = counter("llmserve:auth_failures", "Requests refused for a missing or bad API key.",
                                     ["reason"])
        self.rate_limited = counter("llmserve:rate_limited_requests", "Requests refused by a rate limit (429).",
                                    LABELS + ["limit"])
        self.rate_limit_decisions_without_redis = counter(
            "llmserve:rate_limit_decisions_without_redis",
            "Requests admitted or refused (503) without a rate-limit decision, the limiter's Redis being "
            "unreachable or its circuit open.", LABELS + ["outcome"],
        )
        self.safety_blocks = counter("llmserve:safety_blocks", "Prompts or outputs blocked by the safety filter.",
                                     LABELS + ["stage", "rule"])
        self.routed = counter(
            "llmserve:routed_requests", "Requests a content router sent on, by the model it chose and why "
            "(matched, below_threshold, no_text, unavailable).", ["router", "model_name", "reason"],
        )
        self.batch_requests = counter(
            "llmserve:batch_requests", "Requests of the Batch API's batches answered by this server, by outcome "
            "(succeeded: a 2xx answer; failed: any other).", ["outcome"],
        )
        self.batches_ended = counter(
            "llmserve:batches_ended", "Batches this server ended, by final status (completed, failed, expired, "
            "cancelled).", ["status"],
        )


class ServerMetrics:
    """Every metric family the server exports, made once per app; per-model series carry `model_name`."""

    def __init__(self, endpoints: Callable[[], list[ServedModel]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(endpoints))
        self._endpoints = endpoints

        def counter(name: str, doc: str, labels: list[str] = LABELS) -> Counter:
            return Counter(name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter(
            "vllm:request_success", "Count of finished requests.", LABELS + ["finished_reason"]
        )
        self.goodput = counter("llmserve:goodput_requests", "Finished requests that met every latency SLO set.")
        self.rejected = counter(
            "llmserve:requests_rejected", "Requests turned away at admission.", LABELS + ["reason"]
        )
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency.", TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds", "Decode time per output token.", TOKEN_LATENCY_BUCKETS
        )
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Time spent waiting before first scheduled.", REQUEST_LATENCY_BUCKETS
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds", "Time from first scheduled to first token.", REQUEST_LATENCY_BUCKETS
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds", "Time from first token to the last.", REQUEST_LATENCY_BUCKETS
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Tokens per engine step.", ITERATION_TOKEN_BUCKETS
        )
        self.batch_size = histogram("llmserve:iteration_batch_size", "Sequences per engine step.", BATCH_SIZE_BUCKETS)
        self.platform = PlatformMetrics(self.registry)

    def drain(self) -> None:
        for endpoint in self._endpoints():
            if endpoint.telemetry is not None:
                endpoint.telemetry.drain()


@dataclass
class _Progress:
    num_tokens: int
    last_token_time: float | None


class Telemetry:
    """Engine events -> histograms, token counters, goodput and the SLO load estimate."""

    def __init__(self, metrics: ServerMetrics, model_name: str, slo: SLO) -> None:
        self.metrics = metrics
        self.model_name = model_name
        self.slo = slo
        self.estimator = LoadEstimator()
        self._events: queue.SimpleQueue[EngineEvents] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._progress: dict[str, _Progress] = {}
        # This model's series, looked up once (a labels() lookup per token adds up).
        self._prompt_tokens = metrics.prompt_tokens.labels(model_name)
        self._generation_tokens = metrics.generation_tokens.labels(model_name)
        self._ttft = metrics.ttft.labels(model_name)
        self._itl = metrics.itl.labels(model_name)
        self._iteration_tokens = metrics.iteration_tokens.labels(model_name)
        self._batch_size = metrics.batch_size.labels(model_name)

    # ---- the engine's side: only a queue put ---------------------------------------------------------
    def on_events(self, events: EngineEvents) -> None:
        self._events.put(events)

    # ---- the server's side -------------------------------------------------------------------------
    def drain(self) -> None:
        """Turn every queued event into observations (any thread; serialised)."""
        with self._lock:
            while True:
                try:
                    events = self._events.get_nowait()
                except queue.Empty:
                    return
                if events.step is not None:
                    self._observe_step(events.step)
                for output in events.outputs:
                    self._observe_output(output)

    def reject(self, reason: str) -> None:
        self.metrics.rejected.labels(self.model_name, reason).inc()

    def _observe_step(self, step: StepRecord) -> None:
        self._iteration_tokens.observe(step.num_tokens)
        self._batch_size.observe(step.num_seqs)
        self.estimator.observe(step)

    def _observe_output(self, output: RequestOutput) -> None:
        metrics = output.metrics
        completions = output.outputs
        num_tokens = len(completions[0].token_ids) if len(completions) == 1 else sum(
            len(c.token_ids) for c in completions)
        progress = self._progress.get(output.request_id)
        if progress is None:
            progress = self._progress[output.request_id] = _Progress(0, None)
            if metrics.first_scheduled_time is not None:
                self._prompt_tokens.inc(len(output.prompt_token_ids))
            if metrics.time_to_first_token is not None:
                self._ttft.observe(metrics.time_to_first_token)
        elif metrics.last_token_time is not None and num_tokens > progress.num_tokens:
            self._itl.observe(metrics.last_token_time - (progress.last_token_time or 0.0))
        if num_tokens > progress.num_tokens:
            self._generation_tokens.inc(num_tokens - progress.num_tokens)
            progress.num_tokens = num_tokens
        progress.last_token_time = metrics.last_token_time
        if output.finished:
            del self._progress[output.request_id]
            self._observe_finished(output)

    def _observe_finished(self, output: RequestOutput) -> None:
        name, m = self.model_name, output.metrics
        reason = output.outputs[0].finish_reason if output.outputs else "abort"
        self.metrics.request_success.labels(name, reason or "abort").inc()
        if m.finished_time is not None:
            self.metrics.e2e.labels(name).observe(m.finished_time - m.arrival_time)
        if m.queue_time is not None:
            self.metrics.queue_time.labels(name).observe(m.queue_time)
        tpot = None
        if m.first_token_time is not None and m.first_scheduled_time is not None:
            self.metrics.prefill_time.labels(name).observe(m.first_token_time - m.first_scheduled_time)
            decode = (m.last_token_time or m.first_token_time) - m.first_token_time
            self.metrics.decode_time.labels(name).observe(decode)
            num_tokens = max(len(c.token_ids) for c in output.outputs)
            if num_tokens > 1:
                tpot = decode / (num_tokens - 1)
                self.metrics.tpot.labels(name).observe(tpot)
        if reason != "abort" and self.slo.met(m.time_to_first_token, tpot):
            self.metrics.goodput.labels(name).inc()


def make_telemetry(engine: AsyncLLM, metrics: ServerMetrics, model_name: str, slo: SLO) -> Telemetry:
    telemetry = Telemetry(metrics, model_name, slo)
    engine.add_listener(telemetry.on_events)
    return telemetry


@router.get("/metrics", response_class=PlainTextResponse)  # documented as text: Prometheus's exposition format
async def metrics(request: Request) -> Response:
    server_metrics: ServerMetrics = request.app.state.llmserve.metrics
    server_metrics.drain()
    return Response(generate_latest(server_metrics.registry), media_type=CONTENT_TYPE_LATEST)
