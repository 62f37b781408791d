"""The prefix cache's second tier through the server (its engine core in its own process): a prompt whose
blocks were evicted from a small pool comes back from the tier, billed as cached, with the answer it had;
/metrics counts the blocks saved and loaded; the flags reach the engine config."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve.cli import build_parser
from llmserve.config import EngineConfig, engine_config_kwargs
from tests.server.conftest import LiveServer, serving_config

NAME = "tiny"


@pytest.fixture(scope="module")
def server(tiny_llama_dir) -> Iterator[LiveServer]:
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=24, max_model_len=256,
                          kv_offload_gib=0.01)
    with serving_config(config, NAME) as server:
        yield server


def _complete(server: LiveServer, prompt: list[int]) -> dict:
    response = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
        "model": NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True})
    assert response.status_code == 200, response.text
    return response.json()


def _blocks(server: LiveServer, direction: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return next(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                if sample.name == "llmserve:kv_offload_blocks_total" and sample.labels["direction"] == direction)


def test_an_evicted_prompt_comes_back_from_the_tier(server):
    prompt = [(7 * i + 3) % 250 + 1 for i in range(150)]  # 9 full blocks
    first = _complete(server, prompt)
    for k in range(1, 4):  # three other prompts of 10 blocks each: the pool of 24 has to evict the first's
        _complete(server, [(13 * i + 5 * k) % 240 + 2 for i in range(150)])
    loaded = _blocks(server, "loaded")
    again = _complete(server, prompt)
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 9 * 16
    assert _blocks(server, "loaded") == loaded + 9 and _blocks(server, "saved") >= 9
    stats = server.idle_stats()
    assert stats.num_used_blocks == 0 and stats.kv_offload_blocks >= 9
    server.ask(lambda engine: engine.check_invariants())


def test_the_flags_reach_the_engine_config():
    kwargs = engine_config_kwargs(build_parser().parse_args(
        ["serve", "--kv-offload-gib", "2", "--kv-offload-dir", "/var/cache/llmserve-kv"]))
    assert kwargs["kv_offload_gib"] == 2.0 and kwargs["kv_offload_dir"] == "/var/cache/llmserve-kv"


def test_resetting_the_prefix_cache_empties_the_pool_and_the_tier(server):
    prompt = [(17 * i + 9) % 250 + 1 for i in range(100)]
    _complete(server, prompt)
    assert _complete(server, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 99  # all but the last
    for path in ("/admin/reset_prefix_cache", "/reset_prefix_cache"):  # ours, and vLLM's path
        response = httpx.post(f"{server.base_url}{path}", json={"model": NAME}, timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == NAME
    stats = server.idle_stats()
    assert stats.num_cached_blocks == 0 and stats.kv_offload_blocks == 0
    assert _complete(server, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed again
    missing = httpx.post(f"{server.base_url}/admin/reset_prefix_cache", json={"model": "nope"}, timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
