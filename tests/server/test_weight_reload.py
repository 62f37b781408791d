"""POST /admin/reload: the tiny model's weights replaced in place (seed 0 -> seed 1, same architecture),
with a stream running across the swap; afterwards the server answers token for token as a server
started on the new weights, with no KV of the old weights reused."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmserve.engine.async_llm import AsyncLLM
from llmserve.model.builtin import make_model
from tests.server.conftest import MODEL_NAME, LiveServer, serving
from tests.server.platform_fixtures import MODEL as PLATFORM_MODEL
from tests.server.platform_fixtures import serve_platform, tiny_engine  # noqa: F401 - a fixture

NO_EOS = {"ignore_eos": True}
PROMPT = "The rolling update replaced every replica, one by one, while clients kept asking. " * 3


@pytest.fixture(scope="module")
def new_weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny-llama-seed1"), "llama", "tiny", 1)


@pytest.fixture
def server(tiny_llama_dir: Path) -> Iterator[LiveServer]:
    with serving(tiny_llama_dir, max_model_len=2048) as live:  # room for a stream that outlasts a reload
        yield live


def _complete(base_url: str, **extra: object) -> dict:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 1, **NO_EOS,
            **extra}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _tokens(completion: dict) -> list[str]:
    return completion["choices"][0]["logprobs"]["tokens"]


def test_reload_swaps_weights_under_a_running_stream(server: LiveServer, new_weights_dir: Path) -> None:
    old = _complete(server.base_url)
    assert _complete(server.base_url)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # cached now

    # Four choices of 2000 tokens: on a busy machine the reload's read (a thread of the engine core, which the step
    # loop holds the interpreter from) outlasted one such stream of the tiny model.
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0, "n": 4,
            "stream": True, **NO_EOS}
    events: list[str] = []
    first_event = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first_event.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_event.wait(60)
    reload = httpx.post(f"{server.base_url}/admin/reload", json={"path": str(new_weights_dir)}, timeout=120)
    assert reload.status_code == 200, reload.text
    answer = reload.json()
    assert answer["object"] == "reload" and answer["model"] == MODEL_NAME and answer["path"] == str(new_weights_dir)
    assert answer["cached_blocks_forgotten"] > 0  # the prompt above was cached
    at_swap = len(events)
    reader.join(timeout=120)
    assert at_swap < len(events) - 1, "the stream was still running after the swap"
    assert events[-1] == "[DONE]", "the stream running across the reload completes"
    chunks = [json.loads(event) for event in events[:-1]]
    assert not any("error" in chunk for chunk in chunks)
    assert [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]] == ["length"] * 4
    assert sum(len(c["text"]) > 0 for chunk in chunks for c in chunk["choices"]) >= 100

    new = _complete(server.base_url)
    assert new["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the old weights' KV is gone
    with serving(new_weights_dir) as direct:
        want = _complete(direct.base_url)
    assert _tokens(new) == _tokens(want)
    assert _tokens(new) != _tokens(old)  # sanity: the seeds' weights do answer differently
    assert new["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
        want["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
    server.idle_stats()  # block accounting still exact


def test_reload_refuses_what_does_not_fit(server: LiveServer, tmp_path: Path) -> None:
    before = _complete(server.base_url)
    other = make_model(tmp_path / "small", "llama", "small", 0)  # another shape
    refused = httpx.post(f"{server.base_url}/admin/reload", json={"path": str(other)}, timeout=120)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "weights_not_loaded" and error["param"] == "path" and "shape" in error["message"]
    missing = httpx.post(f"{server.base_url}/admin/reload", json={"path": str(tmp_path / "nowhere")})
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "invalid_path"
    unknown = httpx.post(f"{server.base_url}/admin/reload", json={"path": str(other), "model": "nope"})
    assert unknown.status_code == 404
    extra = httpx.post(f"{server.base_url}/admin/reload", json={"path": str(other), "force": True})
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "force"
    assert _tokens(_complete(server.base_url)) == _tokens(before)  # nothing changed


def test_once_keys_exist_only_an_admin_key_reloads_or_loads_adapters(tiny_engine: AsyncLLM, tiny_llama_dir: Path,  # noqa: F811
                                                   tmp_path: Path) -> None:
    for platform in serve_platform(tiny_engine, tmp_path):
        _, admin = platform.new_key("admin", admin=True)
        _, user = platform.new_key("user")
        body = {"path": str(tiny_llama_dir)}  # the weights it has: the same answers afterwards
        assert httpx.post(f"{platform.base_url}/admin/reload", json=body).status_code == 401
        with platform.client(user) as client:
            refused = client.post("/admin/reload", json=body)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_key_required"
        with platform.client(admin) as client:
            reloaded = client.post("/admin/reload", json=body)
        assert reloaded.status_code == 200 and reloaded.json()["model"] == PLATFORM_MODEL
        adapter = {"lora_name": "a", "lora_path": str(tmp_path)}
        with platform.client(user) as client:
            assert client.post("/v1/load_lora_adapter", json=adapter).status_code == 403
            assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 403
        with platform.client(admin) as client:
            refused = client.post("/v1/load_lora_adapter", json=adapter)
        assert refused.status_code == 400 and "--enable-lora" in refused.json()["error"]["message"]
