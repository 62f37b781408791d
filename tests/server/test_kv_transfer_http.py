"""Disaggregation through the API: two servers started with --kv-transfer, their engine cores in their
own processes. A prefill call keeps its prompt's KV and says where; a decode call on the other server
pulls it and answers (chat and completions, streamed or not) as a plain server does, without billing the
pulled tokens as cached. Requests the API cannot transfer get a 400 naming kv_transfer_params, and the
servers' /metrics count the blocks."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve import LLM, SamplingParams
from llmserve.cli import build_parser
from llmserve.config import EngineConfig, engine_config_kwargs
from tests.server.conftest import LiveServer, serving_config

NAME = "tiny"
PROMPT = "The history of the printing press " * 12  # well over a few 16-token blocks
MAX_NEW = 10


def _config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=512,
                        kv_transfer=True, kv_transfer_host="127.0.0.1")


@pytest.fixture(scope="module")
def pair(tiny_llama_dir) -> Iterator[tuple[LiveServer, LiveServer]]:
    with serving_config(_config(tiny_llama_dir), NAME) as prefill, serving_config(_config(tiny_llama_dir), NAME) as decode:
        yield prefill, decode


@pytest.fixture(scope="module")
def expected(tiny_llama_dir) -> list[int]:
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, max_model_len=512)
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True))[0].outputs[0].token_ids


def _post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json={"model": NAME, **body}, timeout=60)


def _prefill(server: LiveServer, path: str, body: dict) -> dict:
    response = _post(server, path, {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert response.status_code == 200, response.text
    params = response.json()["kv_transfer_params"]
    assert set(params) == {"transfer_id", "remote_host", "remote_port", "num_tokens"}
    assert params["remote_host"] is None and params["num_tokens"] > 0
    return {**params, "do_remote_prefill": True, "remote_host": "127.0.0.1"}


def _metric(server: LiveServer, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"{name} {labels} not in /metrics")


GREEDY = {"temperature": 0, "ignore_eos": True, "return_token_ids": True}


def test_a_completion_decoded_from_pulled_kv_is_the_plain_answer(pair, expected):
    prefill, decode = pair
    sent = _metric(prefill, "llmserve:kv_transfer_blocks_total", direction="sent")
    received = _metric(decode, "llmserve:kv_transfer_blocks_total", direction="received")
    params = _prefill(prefill, "/v1/completions", {"prompt": PROMPT, **GREEDY})
    response = _post(decode, "/v1/completions",
                     {"prompt": PROMPT, "max_tokens": MAX_NEW, **GREEDY, "kv_transfer_params": params})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["token_ids"] == expected
    assert "kv_transfer_params" not in body
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # pulled, not found in a cache
    moved = params["num_tokens"] // 16
    assert _metric(prefill, "llmserve:kv_transfer_blocks_total", direction="sent") == sent + moved
    assert _metric(decode, "llmserve:kv_transfer_blocks_total", direction="received") == received + moved
    for server in pair:
        stats = server.idle_stats()
        assert stats.kv_blocks_held == 0 and stats.num_used_blocks == 0
        server.ask(lambda engine: engine.check_invariants())  # every block free or owned, on both sides


def test_a_streamed_chat_decoded_from_pulled_kv_is_the_plain_answer(pair):
    prefill, decode = pair
    messages = [{"role": "user", "content": PROMPT}]
    # The plain answer, from the prefill server: the decode server must not have the prompt cached.
    plain = _post(prefill, "/v1/chat/completions", {"messages": messages, "max_tokens": MAX_NEW, **GREEDY})
    want = plain.json()["choices"][0]["token_ids"]
    received = _metric(decode, "llmserve:kv_transfer_blocks_total", direction="received")
    failed = _metric(decode, "llmserve:kv_transfer_pulls_failed_total")
    params = _prefill(prefill, "/v1/chat/completions", {"messages": messages, **GREEDY})
    body = {"messages": messages, "max_tokens": MAX_NEW, **GREEDY, "kv_transfer_params": params, "stream": True}
    tokens = []
    with httpx.stream("POST", f"{decode.base_url}/v1/chat/completions", json={"model": NAME, **body}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[len("data: "):])["choices"]:
                    tokens += choice.get("token_ids") or []
    assert tokens == want
    assert _metric(decode, "llmserve:kv_transfer_pulls_failed_total") == failed
    assert _metric(decode, "llmserve:kv_transfer_blocks_total", direction="received") > received


@pytest.mark.parametrize("body, message", [
    ({"prompt": PROMPT, "kv_transfer_params": {"do_remote_decode": True}, "stream": True}, "not streamed"),
    ({"prompt": [PROMPT, PROMPT], "kv_transfer_params": {"do_remote_decode": True}}, "one prompt"),
    ({"prompt": PROMPT, "kv_transfer_params": {"do_remote_decode": True}, "n": 2}, "n = 1"),
    ({"prompt": PROMPT, "kv_transfer_params": {"do_remote_prefill": True}}, "transfer_id, remote_host"),
    ({"prompt": PROMPT, "kv_transfer_params": {"do_remote_decode": True, "remote_engine_id": "x"}}, "remote_engine_id"),
    ({"prompt": PROMPT, "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "a", "remote_host": "h",
                                               "remote_port": 0}}, "remote_port"),
])
def test_transfers_the_api_cannot_do_are_400s_naming_the_field(pair, body, message):
    response = _post(pair[0], "/v1/completions", {"max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"].startswith("kv_transfer_params")
    assert error["type"] == "invalid_request_error"


def test_a_server_without_kv_transfer_refuses_the_field(live_server):
    response = httpx.post(f"{live_server.base_url}/v1/completions", timeout=30, json={
        "model": live_server.model, "prompt": "hi", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "kv_transfer_params"
    assert "--kv-transfer" in response.json()["error"]["message"]


def test_the_flags_reach_the_engine_config():
    args = build_parser().parse_args(["serve", "--kv-transfer", "--kv-transfer-port", "5601", "--kv-transfer-ttl", "5"])
    kwargs = engine_config_kwargs(args)
    assert kwargs["kv_transfer"] is True and kwargs["kv_transfer_port"] == 5601 and kwargs["kv_transfer_ttl"] == 5.0
    assert engine_config_kwargs(build_parser().parse_args(["serve"]))["kv_transfer"] is False
