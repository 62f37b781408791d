"""`--api-key` (vLLM's): one key given at start, not stored, that every request but the public paths must carry,
with or without the platform, in `llmserve serve` and in a gateway; keys made with `llmserve keys create` keep
working beside it, and its requests are metered under its own id."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from llmserve.cli import build_parser
from llmserve.engine.async_llm import AsyncLLM
from llmserve.gateway.app import build_gateway_app
from llmserve.platform.keys import STATIC_KEY_ID
from llmserve.server.app import build_app
from tests.server.conftest import app_serving
from tests.server.platform_fixtures import (
    MODEL,
    MODES,
    chat_body,
    serve_platform,
    tiny_engine,  # noqa: F401 - a fixture
)

SECRET = "token-abc123"  # any text, as vLLM's


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


@contextmanager
def _without_platform(engine: AsyncLLM, mode: str) -> Iterator[str]:
    with ExitStack() as servers:
        if mode == "direct":
            app = build_app(engine, MODEL, api_key=SECRET)
        else:
            replica = servers.enter_context(app_serving(build_app(engine, MODEL)))
            app = build_gateway_app({MODEL: [replica]}, api_key=SECRET)
        yield servers.enter_context(app_serving(app))


def _error_code(response: httpx.Response) -> str:
    return response.json()["error"]["code"]


def test_the_flag_and_its_environment_variable(monkeypatch: pytest.MonkeyPatch):
    for command in ("serve", "gateway"):
        extra = ["--pool", f"{MODEL}=http://127.0.0.1:1"] if command == "gateway" else []
        assert build_parser().parse_args([command, *extra, "--api-key", SECRET]).api_key == SECRET
        monkeypatch.setenv("LLMSERVE_API_KEY", "from-env")
        assert build_parser().parse_args([command, *extra]).api_key == "from-env"
        monkeypatch.delenv("LLMSERVE_API_KEY")
        assert build_parser().parse_args([command, *extra]).api_key is None


@pytest.mark.parametrize("mode", MODES)
def test_without_the_platform_only_the_given_key_gets_in(tiny_engine: AsyncLLM, mode: str):  # noqa: F811
    with _without_platform(tiny_engine, mode) as url, httpx.Client(base_url=url, timeout=60) as client:
        assert client.get("/health").status_code == 200  # public
        missing = client.post("/v1/chat/completions", json=chat_body())
        assert missing.status_code == 401 and _error_code(missing) == "missing_api_key"
        for wrong in ("token-abc124", "sk-llms-" + "a" * 43):
            refused = client.post("/v1/chat/completions", json=chat_body(), headers=_bearer(wrong))
            assert refused.status_code == 401 and _error_code(refused) == "invalid_api_key"
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers=_bearer(SECRET)).status_code == 200
        answered = client.post("/v1/chat/completions", json=chat_body(), headers=_bearer(SECRET))
        assert answered.status_code == 200 and answered.json()["usage"]["completion_tokens"] == 4
        anthropic = client.post("/v1/messages", json={"model": MODEL, "max_tokens": 1, "messages": []})
        assert anthropic.status_code == 401  # in Anthropic's shape, also where a gateway's lane answers it
        assert (anthropic.json()["type"], anthropic.json()["error"]["type"]) == ("error", "authentication_error")


@pytest.mark.parametrize("mode", MODES)
def test_with_the_platform_stored_keys_work_beside_it_and_each_is_metered(
    tiny_engine: AsyncLLM, tmp_path: Path, mode: str  # noqa: F811
):
    for server in serve_platform(tiny_engine, tmp_path, mode=mode, api_key=SECRET):
        stored, stored_secret = server.new_key("stored", rpm=100)
        with server.client() as client:
            assert client.post("/v1/chat/completions", json=chat_body()).status_code == 401
            for secret in (SECRET, stored_secret):
                answered = client.post("/v1/chat/completions", json=chat_body(), headers=_bearer(secret))
                assert answered.status_code == 200, answered.text
            refused = client.post("/v1/chat/completions", json=chat_body(), headers=_bearer("token-abc124"))
            assert refused.status_code == 401 and _error_code(refused) == "invalid_api_key"
        rows = server.wait_for_usage_rows(2)
        assert sorted(row.key_id for row in rows) == sorted([STATIC_KEY_ID, stored.id])
        with server.client() as client:
            # The operator's key is an admin's: its usage report has every key's; a stored key's has its own.
            everyone = client.get("/v1/usage", params={"group_by": "key"}, headers=_bearer(SECRET)).json()
            own = client.get("/v1/usage", params={"group_by": "key"}, headers=_bearer(stored_secret)).json()
        assert sorted(group["group"] for group in everyone["data"]) == sorted([STATIC_KEY_ID, stored.id])
        assert [group["group"] for group in own["data"]] == [stored.id]
