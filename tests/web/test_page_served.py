"""The page over HTTP, without a browser: served at / with its policy, its assets public even when
keys are on (the API is not), and served by the gateway too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from llmserve.engine.async_llm import AsyncLLM
from llmserve.gateway.app import build_gateway_app
from llmserve.web import CONTENT_SECURITY_POLICY, page_paths
from tests.server.platform_fixtures import (
    PlatformServer,
    serve_platform,
    tiny_engine,  # noqa: F401 - a fixture
)


@pytest.fixture
def server(tiny_engine: AsyncLLM, tmp_path: Path) -> Iterator[PlatformServer]:  # noqa: F811
    yield from serve_platform(tiny_engine, tmp_path)


def test_the_page_and_its_assets_need_no_key_but_the_api_does(server: PlatformServer):
    server.new_key("someone")
    assert page_paths() >= {"/", "/web/app.js", "/web/api.js", "/web/markdown.js", "/web/style.css"}
    with httpx.Client(base_url=server.base_url) as http:
        page = http.get("/")
        assets = {path: http.get(path) for path in page_paths() - {"/"}}
        api = http.get("/v1/models")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert '<script type="module" src="/web/app.js">' in page.text
    assert all(response.status_code == 200 for response in assets.values())
    assert assets["/web/app.js"].headers["content-type"].startswith("text/javascript")
    assert api.status_code == 401


def test_the_gateway_serves_the_page():
    client = TestClient(build_gateway_app({"tiny": ["http://127.0.0.1:9"]}))
    assert client.get("/").status_code == 200 and client.get("/web/app.js").status_code == 200
