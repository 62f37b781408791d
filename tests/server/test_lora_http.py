"""LoRA adapters over HTTP (vLLM's): `lora_modules` served under their names at start (listed in /v1/models
with their parent, generating PEFT's tokens), more loaded and unloaded at run time, and the bad requests of
both refused in OpenAI's error shape."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmserve.config import EngineConfig
from tests import hf_reference
from tests.server.conftest import LiveServer, serving_config

BASE = "tiny"
PROMPT = [17, 99, 302, 5, 640, 23, 88, 410, 7, 512, 64]
MAX_NEW = 8


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory, tiny_llama_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-http")
    return {
        "sql": hf_reference.build_lora_adapter(tiny_llama_dir, root / "sql", rank=8, seed=3),
        "poet": hf_reference.build_lora_adapter(tiny_llama_dir, root / "poet", targets=("q_proj", "o_proj"), seed=4),
    }


@pytest.fixture(scope="module")
def server(tiny_llama_dir, adapter_dirs) -> Iterator[LiveServer]:
    config = EngineConfig(
        model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, max_model_len=256,
        lora_modules=[f"sql={adapter_dirs['sql']}"], max_loras=2, max_lora_rank=8,
    )
    with serving_config(config, BASE) as server:
        yield server


def _complete(base_url: str, model: str, **extra) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)


def _tokens(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def _error(response: httpx.Response, status: int, param: str | None) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    return error["message"]


def test_configured_adapter_is_listed_and_generates_peft_tokens(server, tiny_llama_dir, adapter_dirs) -> None:
    base_url = server.base_url
    cards = {card["id"]: card for card in httpx.get(f"{base_url}/v1/models").json()["data"]}
    assert set(cards) == {BASE, "sql"}
    assert cards["sql"]["parent"] == BASE and cards["sql"]["root"] == str(adapter_dirs["sql"].resolve())
    assert cards[BASE]["parent"] is None

    reference = hf_reference.load_with_adapter(tiny_llama_dir, adapter_dirs["sql"])
    response = _complete(base_url, "sql")
    assert response.json()["model"] == "sql"
    assert _tokens(response) == hf_reference.greedy(reference, PROMPT, MAX_NEW)
    assert _tokens(_complete(base_url, BASE)) == hf_reference.greedy(hf_reference.load_model(tiny_llama_dir), PROMPT,
                                                                     MAX_NEW)
    chat = httpx.post(f"{base_url}/v1/chat/completions", timeout=60, json={
        "model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True})
    assert chat.status_code == 200 and '"model":"sql"' in chat.text and chat.text.endswith("data: [DONE]\n\n")

    message = _error(httpx.post(f"{base_url}/v1/embeddings", json={"model": "sql", "input": "x"}), 400, "model")
    assert "LoRA adapter of 'tiny'" in message
    assert server.idle_stats().num_used_blocks == 0
    metrics = httpx.get(f"{base_url}/metrics").text
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics


def test_adapters_load_and_unload_at_run_time(server, tiny_llama_dir, adapter_dirs) -> None:
    base_url = server.base_url
    load = f"{base_url}/v1/load_lora_adapter"
    unload = f"{base_url}/v1/unload_lora_adapter"
    assert "does not exist" in _error(_complete(base_url, "poet"), 404, "model")

    response = httpx.post(load, json={"lora_name": "poet", "lora_path": str(adapter_dirs["poet"])})
    assert response.status_code == 200 and "added successfully" in response.text
    reference = hf_reference.load_with_adapter(tiny_llama_dir, adapter_dirs["poet"])
    assert _tokens(_complete(base_url, "poet")) == hf_reference.greedy(reference, PROMPT, MAX_NEW)
    assert "poet" in {card["id"] for card in httpx.get(f"{base_url}/v1/models").json()["data"]}

    assert "already served" in _error(httpx.post(load, json={"lora_name": "poet", "lora_path": "/x"}), 400, "lora_name")
    assert "already served" in _error(httpx.post(load, json={"lora_name": BASE, "lora_path": "/x"}), 400, "lora_name")
    message = _error(httpx.post(load, json={"lora_name": "new", "lora_path": str(tiny_llama_dir)}), 400, "lora_path")
    assert "No adapter_config.json" in message
    assert "is a LoRA adapter itself" in _error(
        httpx.post(load, json={"lora_name": "new", "lora_path": str(adapter_dirs["poet"]), "model": "sql"}), 400, "model")
    _error(httpx.post(load, json={"lora_name": "new"}), 400, "lora_path")

    response = httpx.post(unload, json={"lora_name": "poet"})
    assert response.status_code == 200 and "removed successfully" in response.text
    _error(_complete(base_url, "poet"), 404, "model")
    assert "cannot be found" in _error(httpx.post(unload, json={"lora_name": "poet"}), 404, "lora_name")
    assert "cannot be found" in _error(httpx.post(unload, json={"lora_name": BASE}), 404, "lora_name")

