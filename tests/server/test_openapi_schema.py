"""Bounded schemathesis runs over every operation of the live server's own OpenAPI document (the tiny
model): whatever the generated input, the answer is never a 5xx, its status code is documented, and
its body matches the documented schema (OpenAI's error shape for errors). Once without keys or a
platform, once with the platform on (keys, limits, usage, conversations) and an admin key, so the
conversation and usage endpoints answer from their database instead of 404.

Each operation gets its own hypothesis run (schemathesis's pytest plugin does not load under pytest 9)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from llmserve.engine.async_llm import AsyncLLM
from tests.server.conftest import LiveServer
from tests.server.platform_fixtures import (
    PlatformServer,
    serve_platform,
    tiny_engine,  # noqa: F401 - a fixture
)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES_PER_OPERATION = 25


def run_every_operation(base_url: str, headers: dict[str, str]) -> int:
    """Fuzz each operation; returns how many there were, raises with every failure found."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", headers=headers)
    operations = [result.ok() for result in schema.get_all_operations()]
    failures = []
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case) -> None:
            case.call_and_validate(base_url=base_url, headers=headers, checks=CHECKS)

        try:
            check()
        except Exception as exc:  # every operation is run; the failures are reported together
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)
    return len(operations)


def test_every_operation_answers_as_documented(live_server: LiveServer):
    assert run_every_operation(live_server.base_url, {}) >= 10


@pytest.fixture
def platform_server(tiny_engine: AsyncLLM, tmp_path: Path) -> Iterator[PlatformServer]:  # noqa: F811
    yield from serve_platform(tiny_engine, tmp_path)


def test_every_operation_answers_as_documented_with_keys_and_the_platform_on(platform_server: PlatformServer):
    _, secret = platform_server.new_key("fuzzer", admin=True, rpm=10**6, tpm=10**9)
    headers = {"Authorization": f"Bearer {secret}"}
    with platform_server.client(secret) as client:  # something for the conversation routes to find
        assert client.post("/v1/conversations", json={}).status_code == 201
    assert run_every_operation(platform_server.base_url, headers) >= 14
