"""The naive transformers baseline server answers the API `llmserve bench serve` uses (in-process)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("transformers")

from fastapi.testclient import TestClient  # noqa: E402

SERVER_FILE = Path(__file__).resolve().parents[2] / "benchmarks" / "baselines" / "hf_server.py"


def _load_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hf_baseline_server", SERVER_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def client(tiny_llama_dir: Path) -> TestClient:
    module = _load_module()
    engine = module.HFEngine(str(tiny_llama_dir), "bfloat16", "tiny")
    return TestClient(module.build_app(engine))


def _events(response: Any) -> list[Any]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_streaming_completion_ignores_eos_and_reports_usage(client: TestClient) -> None:
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 130, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = _events(response)
    assert events[-1] == "[DONE]"
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 130  # the tiny model emits EOS well before 130 tokens
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    full = client.post("/v1/completions", json={**body, "stream": False}).json()
    assert full["choices"][0]["text"] == text  # greedy: streaming and non-streaming agree


def test_chat_and_tokenize(client: TestClient) -> None:
    messages = [{"role": "user", "content": "hi there"}]
    with client.stream("POST", "/v1/chat/completions",
                       json={"messages": messages, "max_tokens": 5, "stream": True, "ignore_eos": True,
                             "stream_options": {"include_usage": True}}) as response:
        events = _events(response)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["usage"]["completion_tokens"] == 5
    tokens = client.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"


def test_rejects_bad_requests(client: TestClient) -> None:
    too_long = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 100000})
    assert too_long.status_code == 400 and "context" in too_long.json()["error"]["message"]
    assert client.post("/v1/completions", json={"prompt": [[1], [2]], "max_tokens": 2}).status_code == 400
