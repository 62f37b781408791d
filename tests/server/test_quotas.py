"""Token quotas over HTTP, in `llmserve serve` and behind `llmserve gateway`: a key is refused with OpenAI's
429 `insufficient_quota` once its use in the period reaches its quota, running requests hold their
reservation, /v1/usage shows the quota, and a quota raised with `keys update` applies within the key cache's ttl."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve.engine.async_llm import AsyncLLM
from tests.server.platform_fixtures import (
    MODEL,
    MODES,
    PlatformServer,
    chat_body,
    serve_platform,
    tiny_engine,  # noqa: F401 - a fixture
)

MAX_TOKENS = 4


@pytest.fixture(params=MODES)
def server(tiny_engine: AsyncLLM, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[PlatformServer]:  # noqa: F811
    yield from serve_platform(tiny_engine, tmp_path, mode=request.param)


def prompt_tokens(client: httpx.Client, body: dict) -> int:
    return client.post("/tokenize", json={"model": MODEL, "messages": body["messages"]}).json()["count"]


def refused_by_quota(response: httpx.Response) -> dict:
    assert response.status_code == 429, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert (body["error"]["type"], body["error"]["code"]) == ("insufficient_quota", "insufficient_quota")
    return body["error"]


def quota_refusals(base_url: str, key: str) -> float:
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {key}"}).raise_for_status().text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "llmserve:rate_limited_requests_total" and sample.labels.get("limit") == "quota")


def test_a_key_is_refused_once_its_days_quota_is_used_and_sees_it_in_its_usage(server: PlatformServer) -> None:
    if (datetime.now(timezone.utc) + timedelta(minutes=1)).date() != datetime.now(timezone.utc).date():
        pytest.skip("the day's quota would renew during the test")
    body = chat_body(max_tokens=MAX_TOKENS, ignore_eos=True)
    _, admin = server.new_key("admin", admin=True)
    with server.client(admin) as client:
        per_request = prompt_tokens(client, body) + MAX_TOKENS
    quota = 2 * per_request + 1  # three requests start under it; the fourth finds it used
    _, secret = server.new_key("metered", token_quota=quota, quota_period="day")
    with server.client(secret) as client:
        answers = [client.post("/v1/chat/completions", json=body) for _ in range(4)]
        streamed = client.post("/v1/chat/completions", json={**body, "stream": True})
        usage = client.get("/v1/usage").json()
    assert [a.status_code for a in answers[:3]] == [200, 200, 200]
    assert [a.json()["usage"]["total_tokens"] for a in answers[:3]] == [per_request] * 3
    error = refused_by_quota(answers[3])
    tomorrow = (datetime.now(timezone.utc) + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    assert error["message"] == (
        f"You exceeded your token quota of {quota} tokens per day: {3 * per_request} used; "
        f"it renews at {tomorrow.isoformat().replace('+00:00', 'Z')}."
    )
    until_tomorrow = (tomorrow - datetime.now(timezone.utc)).total_seconds()
    assert until_tomorrow <= int(answers[3].headers["retry-after"]) <= math.ceil(until_tomorrow) + 10
    refused_by_quota(streamed)  # refused before any stream starts
    assert usage["quota"] == {"tokens": quota, "period": "day", "used": 3 * per_request, "remaining": 0,
                              "resets_at": tomorrow.isoformat()}
    assert len(server.wait_for_usage_rows(3)) == 3  # the refused ones are not metered
    assert quota_refusals(server.base_url, admin) == 2


def test_a_running_stream_holds_its_reservation_until_it_ends(server: PlatformServer) -> None:
    stream_tokens = 200
    long_stream = chat_body(max_tokens=stream_tokens, stream=True, ignore_eos=True)
    _, admin = server.new_key("admin", admin=True)
    with server.client(admin) as client:
        reserve = prompt_tokens(client, long_stream) + stream_tokens
    _, secret = server.new_key("held", token_quota=reserve, quota_period="month")  # the stream holds all of it
    with server.client(secret) as client:
        with client.stream("POST", "/v1/chat/completions", json=long_stream) as running:
            assert running.status_code == 200
            while_running = client.post("/v1/chat/completions", json=chat_body(max_tokens=1))
        (row,) = server.wait_for_usage_rows(1)  # the stream, cut short, is metered with what it used
        after = client.post("/v1/chat/completions", json=chat_body(max_tokens=1))
    error = refused_by_quota(while_running)
    assert error["message"].endswith(f"0 used, the other {reserve} held by this key's running requests.")
    assert while_running.headers["retry-after"] == "1"
    assert row.prompt_tokens + row.completion_tokens < reserve
    assert after.status_code == 200, after.text


def test_a_request_the_rate_limit_refuses_gives_its_quota_hold_back(server: PlatformServer) -> None:
    key, secret = server.new_key("both", rpm=1, token_quota=10_000, quota_period="week")
    with server.client(secret) as client:
        first = client.post("/v1/chat/completions", json=chat_body())
        second = client.post("/v1/chat/completions", json=chat_body())
    assert first.status_code == 200
    assert second.status_code == 429 and second.json()["error"]["code"] == "rate_limit_exceeded"
    server.wait_for_usage_rows(1)
    assert server.platform.quotas is not None
    state = asyncio.run(server.platform.quotas.state(key))  # read already: answered from memory
    assert (state.used, state.held) == (first.json()["usage"]["total_tokens"], 0)


def test_a_quota_raised_with_keys_update_applies_within_the_key_caches_ttl(server: PlatformServer) -> None:
    key, secret = server.new_key("small", token_quota=1, quota_period="total")
    with server.client(secret) as client:
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200
        spent = client.post("/v1/chat/completions", json=chat_body())
        server.keys.update(key.id, token_quota=1_000_000)
        server.clock.advance(2.1)  # the key cache's ttl
        raised = client.post("/v1/chat/completions", json=chat_body())
    assert refused_by_quota(spent)["message"].endswith("; it does not renew. Ask for a larger quota.")
    assert "retry-after" not in spent.headers
    assert raised.status_code == 200
