"""The server with prefix caching, priorities and SLO admission: cached_tokens on a conversation's
second turn, /metrics parsed with prometheus_client and its counters equal to what was sent, the
--scheduling-policy / --no-prefix-caching / --slo-* flags, and SLO admission's 503."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve.cli import build_parser
from llmserve.config import EngineConfig, engine_config_kwargs
from llmserve.engine.async_llm import AsyncLLM, EngineEvents
from llmserve.engine.messages import StepRecord
from llmserve.server.app import build_app
from llmserve.server.slo import SLO
from tests.server.conftest import MODEL_NAME, start_server

BLOCK = 16
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def http(live_server):
    with httpx.Client(base_url=live_server.base_url, timeout=60) as client:
        yield client


def _tokens(http: httpx.Client, messages: list[dict]) -> list[int]:
    return http.post("/tokenize", json={"messages": messages}).json()["tokens"]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _scrape(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    """Every sample as {(name, sorted labels): value}."""
    samples = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted({"model_name": MODEL_NAME, **labels}.items()))), 0.0)


def test_second_turn_reports_the_reused_prefix(live_server, http):
    client = live_server.client()
    system = "You are a terse assistant that answers in one word. " * 6
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}]
    first = client.chat.completions.create(model=MODEL_NAME, messages=turn1, max_tokens=1, extra_body=NO_EOS)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = turn1 + [
        {"role": "assistant", "content": "Blue."},  # not what it generated: tokenized as any text
        {"role": "user", "content": "Another one."},
    ]
    second = client.chat.completions.create(model=MODEL_NAME, messages=turn2, max_tokens=4, extra_body=NO_EOS)
    prompt1, prompt2 = _tokens(http, turn1), _tokens(http, turn2)
    assert second.usage.prompt_tokens == len(prompt2)
    # Turn 1 computed its whole prompt (one output token: nothing else); turn 2 reuses what both
    # prompts start with, keeping at least its own last token to compute: the full blocks by content,
    # and the rest of the common part from turn 1's partly filled last block (handed over whole).
    reusable = min(_common_prefix(prompt1, prompt2), len(prompt2) - 1)
    assert reusable >= 3 * BLOCK and reusable % BLOCK
    assert second.usage.prompt_tokens_details.cached_tokens == reusable
    live_server.idle_stats()


def test_a_follow_up_turn_reuses_the_previous_reply_kv_even_when_it_re_tokenizes_differently(live_server, http):
    client = live_server.client()
    turn1 = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    first = client.chat.completions.create(model=MODEL_NAME, messages=turn1, max_tokens=40, extra_body=NO_EOS)
    reply = first.choices[0].message.content
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]
    second = client.chat.completions.create(model=MODEL_NAME, messages=turn2, max_tokens=2, extra_body=NO_EOS)
    # Turn 1 computed KV for its prompt and every generated token but the last; turn 2's prompt starts
    # with exactly those tokens (the reply as generated, not as its text re-tokenizes), so all of them
    # are reused: the full blocks and the partly filled last one.
    computed = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert second.usage.prompt_tokens_details.cached_tokens == computed
    assert second.usage.prompt_tokens > computed
    live_server.idle_stats()


def test_metrics_parse_and_counters_equal_what_was_sent(live_server, http):
    before = _scrape(http)
    prompts = [[11 + i] * (20 + 7 * i) for i in range(4)]
    max_tokens = [3, 5, 7, 9]
    for prompt, n in zip(prompts, max_tokens, strict=True):
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": n, "temperature": 0, **NO_EOS}
        assert http.post("/v1/completions", json=body).status_code == 200
    stats = live_server.idle_stats()
    after = _scrape(http)

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == sum(len(p) for p in prompts)
    assert delta("vllm:generation_tokens_total") == sum(max_tokens)
    assert delta("vllm:request_success_total", finished_reason="length") == 4
    assert delta("llmserve:goodput_requests_total") == 4  # no SLO set: every finished request counts
    for name in (
        "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
        "vllm:request_time_per_output_token_seconds",
    ):
        assert delta(name + "_count") == 4, name
    assert delta("vllm:inter_token_latency_seconds_count") == sum(n - 1 for n in max_tokens)
    hits = delta("vllm:prefix_cache_hits_total")
    assert delta("vllm:prefix_cache_queries_total") == sum(len(p) for p in prompts)
    assert _value(after, "vllm:prefix_cache_hits_total") == stats.prefix_cache_hits
    # Every token a forward pass computed: prompts less cached tokens, and all outputs but the last.
    computed = sum(len(p) for p in prompts) - hits + sum(n - 1 for n in max_tokens)
    assert delta("vllm:iteration_tokens_total_sum") == computed
    assert _value(after, "vllm:num_requests_running") == 0
    assert _value(after, "vllm:num_preemptions_total") == stats.num_preemptions


def test_engine_flags_reach_the_engine_config():
    args = build_parser().parse_args(
        ["serve", "--scheduling-policy", "priority", "--no-prefix-caching", "--slo-ttft-ms", "250", "--slo-tpot-ms", "40"]
    )
    kwargs = engine_config_kwargs(args)
    assert kwargs["scheduling_policy"] == "priority" and kwargs["enable_prefix_caching"] is False
    assert (args.slo_ttft_ms, args.slo_tpot_ms) == (250.0, 40.0)
    assert engine_config_kwargs(build_parser().parse_args(["serve"]))["enable_prefix_caching"] is True


@pytest.fixture
def priority_server(tiny_llama_dir):
    engine = AsyncLLM.from_config(
        EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, max_model_len=256,
                     scheduling_policy="priority", max_num_seqs=1)
    )
    app = build_app(engine, MODEL_NAME, slo=SLO(ttft_ms=500))
    server, thread, base_url, _ = start_server(app)
    try:
        yield engine, app, base_url
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.close()


def test_priority_field_orders_the_waiting_queue(priority_server):
    engine, _, base_url = priority_server  # one sequence runs at a time; the rest wait in the core's queue

    async def main() -> list[int]:
        finished: list[int] = []
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:

            async def send(priority: int) -> None:
                body = {"model": MODEL_NAME, "prompt": [5] * 10, "max_tokens": 2, "priority": priority}
                (await http.post("/v1/completions", json=body)).raise_for_status()
                finished.append(priority)

            blocker = {"model": MODEL_NAME, "prompt": [7] * 10, "max_tokens": 200, "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/completions", json=blocker) as stream:
                lines = stream.aiter_lines()
                while not (await anext(lines)).startswith("data: "):
                    pass  # the blocker runs
                senders = [asyncio.ensure_future(send(priority)) for priority in (5, 9, 0)]
                while engine.num_waiting < 3:  # published by the engine core with every step
                    await asyncio.sleep(0.01)
            await asyncio.gather(*senders)
        return finished

    assert asyncio.run(main()) == [0, 5, 9]  # the most urgent first, whatever the arrival order


def test_slo_admission_turns_away_what_cannot_meet_the_ttft_target(priority_server):
    engine, app, base_url = priority_server
    telemetry = app.state.llmserve.default.telemetry
    # Teach the estimator a slow machine: 10 ms per prefill token, so a 100-token prompt needs 1 s.
    telemetry.on_events(EngineEvents(StepRecord(0.0, 0.64, 64, 64, 1, 0, 0), []))
    body = {"model": MODEL_NAME, "prompt": [5] * 100, "max_tokens": 2}
    refused = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "overloaded"
    assert refused.headers["Retry-After"] == "1"
    short = httpx.post(f"{base_url}/v1/completions", json={**body, "prompt": [5] * 20}, timeout=60)
    assert short.status_code == 200
    samples = _scrape(httpx.Client(base_url=base_url))
    assert _value(samples, "llmserve:requests_rejected_total", reason="slo_ttft") == 1

