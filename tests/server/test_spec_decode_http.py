"""Speculative decoding through the server, by n-grams and by a draft model (the served model drafting for
itself): `--speculative-config` reaches the engine core process, a streamed completion carries the tokens decoding one at a time gives (several a chunk where drafts were
accepted) with its usage, and /metrics has vLLM's spec_decode counters."""

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

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPT = "Once upon a time"
MAX_NEW = 48


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def server(request, cycling_llama_dir) -> Iterator[LiveServer]:
    speculative = NGRAM if request.param == "ngram" else {"model": str(cycling_llama_dir), "num_speculative_tokens": 4}
    config = EngineConfig(
        model=str(cycling_llama_dir), dtype="float32", num_kv_blocks=64, max_model_len=256,
        speculative_config=speculative,
    )
    with serving_config(config, "cycling") as server:
        yield server


def test_the_flag_reaches_the_engine_config():
    args = build_parser().parse_args(["serve", "--speculative-config", json.dumps(NGRAM)])
    assert engine_config_kwargs(args)["speculative_config"] == NGRAM
    assert engine_config_kwargs(build_parser().parse_args(["serve"]))["speculative_config"] is None


def test_a_streamed_completion_has_the_tokens_of_plain_decoding_and_metrics_count_the_drafts(server, cycling_llama_dir):
    expected = LLM(str(cycling_llama_dir), dtype="float32", num_kv_blocks=64, max_model_len=256).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    )[0].outputs[0].token_ids
    body = {"model": "cycling", "prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}
    tokens, pieces, usage = [], [], None
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            for choice in chunk["choices"]:
                tokens += choice.get("token_ids") or []
                pieces.append(len(choice.get("token_ids") or []))
            usage = chunk.get("usage") or usage
    assert tokens == expected and usage["completion_tokens"] == MAX_NEW
    assert max(pieces) > 1  # accepted drafts arrive together

    samples = {
        (sample.name, sample.labels.get("position")): sample.value
        for family in text_string_to_metric_families(httpx.get(f"{server.base_url}/metrics").text)
        for sample in family.samples if sample.name.startswith("vllm:spec_decode")
    }
    drafted = samples[("vllm:spec_decode_num_draft_tokens_total", None)]
    accepted = samples[("vllm:spec_decode_num_accepted_tokens_total", None)]
    assert samples[("vllm:spec_decode_num_drafts_total", None)] > 0 and 0 < accepted <= drafted
    # Each step (the prompt's, then one per draft verified) gave one token of the model's, the rest are drafts.
    assert accepted == MAX_NEW - server.engine.last_stats.num_steps
    assert sum(v for (name, pos), v in samples.items() if pos is not None) == accepted
