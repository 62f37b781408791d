"""A rate limiter whose Redis hangs, over HTTP: closed mode answers 503 with Retry-After in OpenAI's
error shape, open mode serves, /metrics counts both, and the flags of `llmserve serve` and `llmserve
gateway` reach the platform; in `llmserve serve` and in a gateway alike."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve.cli import build_parser
from llmserve.engine.async_llm import AsyncLLM
from llmserve.gateway.app import build_gateway_app
from llmserve.platform.keys import KeyCache, KeyStore
from llmserve.platform.ratelimit_redis import CircuitBreaker, RedisRateLimiter
from llmserve.server.app import build_app
from llmserve.server.gateway import Platform
from llmserve.server.platform_options import build_platform
from llmserve.store.db import open_database
from tests.server.conftest import app_serving
from tests.server.platform_fixtures import MODEL, MODES, chat_body, tiny_engine  # noqa: F401 - a fixture


@pytest.fixture
def hung_redis_url(hung_redis_port: int) -> str:
    return f"redis://127.0.0.1:{hung_redis_port}/0"


def decisions_without_redis(client: httpx.Client, outcome: str) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "llmserve:rate_limit_decisions_without_redis_total" and sample.labels == {
                "model_name": MODEL, "outcome": outcome,
            }:
                return sample.value
    return 0.0


@contextmanager
def platform_app(engine: AsyncLLM, platform: Platform, mode: str) -> Iterator[str]:
    """The platform in `llmserve serve`'s app ("direct") or in a gateway before a replica ("gateway")."""
    with ExitStack() as servers:
        if mode == "direct":
            app = build_app(engine, MODEL, platform=platform)
        else:
            app = build_gateway_app({MODEL: [servers.enter_context(app_serving(build_app(engine, MODEL)))]},
                                    platform=platform)
        yield servers.enter_context(app_serving(app))


@pytest.mark.parametrize("mode", MODES)
def test_a_hung_redis_gets_503_when_closed_and_service_when_open(
    tiny_engine: AsyncLLM, tmp_path: Path, hung_redis_url: str, mode: str  # noqa: F811
) -> None:
    database = open_database(f"sqlite:///{tmp_path / 'platform.db'}")
    keys = KeyStore(database)
    _, secret = keys.create("limited", rpm=100, tpm=10_000)
    limiter = RedisRateLimiter(hung_redis_url, timeout_s=0.05, breaker=CircuitBreaker("hung", 3, 60.0))
    platform = Platform(keys=KeyCache(keys), limiter=limiter, database=database, rate_limit_failure_mode="closed")
    with platform_app(tiny_engine, platform, mode) as base_url:
        with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {secret}"}, timeout=60) as client:
            refused = [client.post("/v1/chat/completions", json=chat_body()) for _ in range(5)]
            platform.rate_limit_failure_mode = "open"
            served = client.post("/v1/chat/completions", json=chat_body())
            counts = decisions_without_redis(client, "rejected"), decisions_without_redis(client, "admitted")
    assert [r.status_code for r in refused] == [503] * 5
    assert limiter.breaker.state == "open"
    assert refused[-1].json() == {"error": {
        "message": "Rate limiting is unavailable; retry later.", "type": "service_unavailable_error",
        "param": None, "code": "rate_limiter_unavailable",
    }}
    assert 58 <= int(refused[-1].headers["retry-after"]) <= 60  # when Redis is next tried
    assert served.status_code == 200
    assert "x-ratelimit-limit-requests" not in served.headers  # no decision, so no rate-limit headers
    assert counts == (5, 1)


@pytest.mark.parametrize("command", [["serve"], ["gateway", "--pool", f"{MODEL}=http://127.0.0.1:8000"]])
def test_serve_flags_set_the_failure_mode_and_timeout(tmp_path: Path, command: list[str]) -> None:
    args = build_parser().parse_args([
        *command, "--database-url", f"sqlite:///{tmp_path / 'p.db'}", "--redis-url", "redis://127.0.0.1:6379/0",
        "--rate-limit-failure-mode", "closed", "--redis-timeout-ms", "80",
    ])
    platform = build_platform(args, None)
    assert platform is not None
    try:
        assert platform.rate_limit_failure_mode == "closed"
        assert isinstance(platform.limiter, RedisRateLimiter)
        assert platform.limiter.reply_timeout_s == 0.08
    finally:
        asyncio.run(platform.aclose())
    assert build_parser().parse_args(command).rate_limit_failure_mode == "open"
    with pytest.raises(SystemExit):
        build_parser().parse_args([*command, "--rate-limit-failure-mode", "maybe"])
