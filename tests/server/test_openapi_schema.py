"""A bounded schemathesis run over every operation of the live server's own OpenAPI document (the tiny
model, no keys configured): whatever the generated input, the answer is never a 5xx, its status code
is documented, and its body matches the documented schema (OpenAI's error shape for errors).

Each operation gets its own hypothesis run (schemathesis's pytest plugin does not load under pytest 9)."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.server.conftest import LiveServer

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES_PER_OPERATION = 25


def test_every_operation_answers_as_documented(live_server: LiveServer):
    schema = schemathesis.openapi.from_url(f"{live_server.base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    failures = []
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case) -> None:
            case.call_and_validate(base_url=live_server.base_url, checks=CHECKS)

        try:
            check()
        except Exception as exc:  # every operation is run; the failures are reported together
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)
