"""What the server shows to whom: once keys exist every route but /health needs one (decided route by
route, so a new route fails here until someone decides), tokenize follows a key's models, /metrics
and /openapi.json open only by flag, CORS for the origins allowed, and /v1/models never shows a path."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.routing import iter_route_contexts
from starlette.routing import Mount

from llmserve.cli import build_parser
from llmserve.engine.async_llm import AsyncLLM
from llmserve.server.app import ModelSpec
from llmserve.server.cors import parse_origins
from llmserve.server.serve import make_app
from tests.server.conftest import one_thread_engine_cores, start_server
from tests.server.platform_fixtures import (
    MODES,
    PlatformServer,
    chat_body,
    serve_platform,
    tiny_engine,  # noqa: F401 - a fixture
)

PUBLIC, KEY = "public", "key"
# Every route the app registers, and who may call it once keys exist.
ROUTE_ACCESS = {
    "/health": PUBLIC,
    "/version": KEY,
    "/metrics": KEY,
    "/openapi.json": KEY,
    "/tokenize": KEY,
    "/detokenize": KEY,
    "/v1/models": KEY,
    "/v1/models/{model_id:path}": KEY,
    "/v1/completions": KEY,
    "/v1/chat/completions": KEY,
    "/v1/chat/completions/{completion_id}": KEY,
    "/v1/chat/completions/{completion_id}/messages": KEY,
    "/v1/responses": KEY,
    "/v1/responses/input_tokens": KEY,
    "/v1/responses/{response_id}": KEY,
    "/v1/responses/{response_id}/input_items": KEY,
    "/v1/responses/{response_id}/cancel": KEY,
    "/v1/score": KEY,
    "/score": KEY,
    "/v1/rerank": KEY,
    "/rerank": KEY,
    "/v2/rerank": KEY,
    "/classify": KEY,
    "/v1/moderations": KEY,
    "/v1/messages": KEY,
    "/v1/messages/count_tokens": KEY,
    "/v1/embeddings": KEY,
    "/v1/usage": KEY,
    "/v1/conversations": KEY,
    "/v1/conversations/{conversation_id}": KEY,
    "/v1/conversations/{conversation_id}/messages": KEY,
    "/v1/conversations/{conversation_id}/items": KEY,
    "/v1/conversations/{conversation_id}/items/{item_id}": KEY,
    "/admin/reload": KEY,  # an admin key, in fact (test_weight_reload.py)
    "/admin/reset_prefix_cache": KEY,  # an admin key, in fact (test_kv_offload_http.py)
    "/reset_prefix_cache": KEY,  # vLLM's path for it
    "/v1/load_lora_adapter": KEY,  # an admin key, in fact
    "/v1/unload_lora_adapter": KEY,  # an admin key, in fact
    "/v1/conversations/{conversation_id}/tree": KEY,
    "/v1/streams/{stream_id}": KEY,
    "/v1/files": KEY,
    "/v1/files/{file_id}": KEY,
    "/v1/files/{file_id}/content": KEY,
    "/v1/batches": KEY,
    "/v1/batches/{batch_id}": KEY,
    "/v1/batches/{batch_id}/cancel": KEY,
    "/v1/messages/batches": KEY,
    "/v1/messages/batches/{message_batch_id}": KEY,
    "/v1/messages/batches/{message_batch_id}/cancel": KEY,
    "/v1/messages/batches/{message_batch_id}/results": KEY,
    "/": PUBLIC,  # the chat page: it asks for a key itself
    "/web": PUBLIC,  # the page's assets (a mount: one of its files is requested)
}
# The routes a gateway does not have: they are about a replica's own process, not the platform.
NOT_IN_GATEWAY = {
    "/version",  # each replica's llmserve version
    "/admin/reload",  # weights live in the replicas (reloaded on each, behind the gateway)
    "/admin/reset_prefix_cache",  # so do their KV caches
    "/reset_prefix_cache",
    "/v1/load_lora_adapter",  # so do adapters: each replica is given its own
    "/v1/unload_lora_adapter",
}
ORIGIN = "https://chat.example"


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    """The platform in `llmserve serve` or in `llmserve gateway`."""
    return request.param


@pytest.fixture
def server(tiny_engine: AsyncLLM, tmp_path: Path, mode: str) -> Iterator[PlatformServer]:  # noqa: F811
    yield from serve_platform(tiny_engine, tmp_path, mode=mode)


def _with_keys(server: PlatformServer) -> str:
    _, secret = server.new_key("alice")
    server.clock.advance(3)  # past the cached "no keys exist"
    return secret


def _requests(server: PlatformServer, mode: str) -> list[tuple[str, str, str]]:
    """(method, a concrete path, the route's path) for every method of every route the app has."""
    assert server.app is not None
    routes = list(iter_route_contexts(server.app.routes))  # the app's routes, included routers flattened
    undecided = sorted({r.path for r in routes} - set(ROUTE_ACCESS))
    assert not undecided, f"decide who may call {undecided} (add them to ROUTE_ACCESS)"
    expected = set(ROUTE_ACCESS) - (NOT_IN_GATEWAY if mode == "gateway" else set())
    assert {r.path for r in routes} == expected
    return [
        (method, f"{route.path}/app.js" if isinstance(route.route, Mount) else re.sub(r"\{[^}]+\}", "unknown-id", route.path),
         route.path)
        for route in routes
        for method in sorted(getattr(route, "methods", None) or {"GET"})
    ]


def test_once_keys_exist_every_route_but_health_needs_one(server: PlatformServer, mode: str) -> None:
    secret = _with_keys(server)
    requests = _requests(server, mode)
    with server.client() as anonymous, server.client(secret) as client:
        for method, path, route in requests:
            body = {} if method == "POST" else None
            without = anonymous.request(method, path, json=body)
            expected = 401 if ROUTE_ACCESS[route] == KEY else 200
            assert without.status_code == expected, (method, path, without.text)
            with_key = client.request(method, path, json=body)
            assert with_key.status_code != 401, (method, path, with_key.text)
        # Without --allowed-origins a browser's preflight is just another request without a key.
        preflight = anonymous.options("/v1/chat/completions", headers=_preflight_headers(ORIGIN))
    assert preflight.status_code == 401
    assert "access-control-allow-origin" not in preflight.headers


def test_tokenize_and_detokenize_follow_the_keys_models(tiny_engine: AsyncLLM, tmp_path: Path, mode: str) -> None:  # noqa: F811
    models = [ModelSpec("small", tiny_engine), ModelSpec("large", tiny_engine)]
    for server in serve_platform(tiny_engine, tmp_path, models=models, mode=mode):
        _, secret = server.new_key("bob", models=["small"])
        with server.client(secret) as client:
            allowed = client.post("/tokenize", json={"model": "small", "prompt": "Hello"})
            default = client.post("/tokenize", json={"prompt": "Hello"})  # the first model: small
            denied = client.post("/tokenize", json={"model": "large", "prompt": "Hello"})
            denied_back = client.post("/detokenize", json={"model": "large", "tokens": [1, 2]})
            denied_chat = client.post("/v1/chat/completions", json=chat_body(model="large"))
        assert allowed.status_code == default.status_code == 200 and allowed.json()["count"] > 0
        for response in (denied, denied_back):
            assert response.status_code == denied_chat.status_code == 404
            assert response.json() == {
                "error": {**denied_chat.json()["error"], "message": response.json()["error"]["message"]}
            }
            assert response.json()["error"]["code"] == "model_not_found"


def test_metrics_and_openapi_are_public_only_by_flag(tiny_engine: AsyncLLM, tmp_path: Path, mode: str) -> None:  # noqa: F811
    for server in serve_platform(tiny_engine, tmp_path, public_metrics=True, public_openapi=True, mode=mode):
        _with_keys(server)
        with server.client() as anonymous:
            metrics = anonymous.get("/metrics")
            openapi = anonymous.get("/openapi.json")
            version = anonymous.get("/version")
            tokenize = anonymous.post("/tokenize", json={"prompt": "Hello"})
        # The engine's metrics in a server; the replicas' health in a gateway (each replica has its engine's).
        metric = "vllm:num_requests_running" if mode == "direct" else "llmserve:gateway_replica_healthy"
        assert metrics.status_code == 200 and metric in metrics.text
        title = "llmserve" if mode == "direct" else "llmserve gateway"
        assert openapi.status_code == 200 and openapi.json()["info"]["title"] == title
        assert (version.status_code, tokenize.status_code) == (401, 401)


def _preflight_headers(origin: str) -> dict[str, str]:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }


def test_cors_answers_preflights_without_a_key_and_marks_errors(tiny_engine: AsyncLLM, tmp_path: Path, mode: str) -> None:  # noqa: F811
    for server in serve_platform(tiny_engine, tmp_path, allowed_origins=[ORIGIN], mode=mode):
        _, secret = server.new_key("carol", rpm=1)
        server.clock.advance(3)
        with server.client() as anonymous:
            preflight = anonymous.options("/v1/chat/completions", headers=_preflight_headers(ORIGIN))
            foreign = anonymous.options("/v1/chat/completions", headers=_preflight_headers("https://evil.example"))
            unauthorized = anonymous.post("/v1/chat/completions", json=chat_body(), headers={"Origin": ORIGIN})
        with server.client(secret) as client:
            first = client.post("/v1/chat/completions", json=chat_body(max_tokens=1), headers={"Origin": ORIGIN})
            limited = client.post("/v1/chat/completions", json=chat_body(max_tokens=1), headers={"Origin": ORIGIN})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        assert "access-control-allow-origin" not in foreign.headers
        assert unauthorized.status_code == 401
        assert unauthorized.headers["access-control-allow-origin"] == ORIGIN
        assert (first.status_code, limited.status_code) == (200, 429)
        assert limited.headers["access-control-allow-origin"] == ORIGIN
        exposed = limited.headers["access-control-expose-headers"].lower()
        assert "retry-after" in exposed and "x-ratelimit-remaining-requests" in exposed
    assert parse_origins(["https://a.example,https://b.example", " * "]) == [
        "https://a.example", "https://b.example", "*",
    ]


def test_a_model_served_from_a_directory_is_listed_by_name_not_path(tiny_llama_dir: Path) -> None:
    # `llmserve serve` only: a gateway's models are its pools, named by --pool NAME=..., never by a path.
    args = build_parser().parse_args([
        "serve", "--model", str(tiny_llama_dir), "--no-platform", "--dtype", "float32",
        "--num-kv-blocks", "64", "--max-model-len", "256",
    ])
    with one_thread_engine_cores():
        app = make_app(args, None, None)
        state = app.state.llmserve
        server, thread, base_url, loop = start_server(app)
        try:
            asyncio.run_coroutine_threadsafe(state.wait_ready(), loop).result(timeout=120)
            with httpx.Client(base_url=base_url, timeout=60) as client:
                cards = client.get("/v1/models").json()["data"]
                by_path = client.post("/tokenize", json={"model": str(tiny_llama_dir), "prompt": "Hi"})
                card_by_path = client.get(f"/v1/models/{tiny_llama_dir}").json()
        finally:
            server.should_exit = True
            thread.join(timeout=60)
            for endpoint in state.endpoints():
                endpoint.engine.close(timeout=10)
    assert [card["id"] for card in cards] == [tiny_llama_dir.name]
    assert all("/" not in (card["root"] or "") for card in cards)
    assert by_path.status_code == 200  # the path as typed still names the model in requests
    assert card_by_path["id"] == tiny_llama_dir.name
