"""`use_beam_search` through the server (vLLM's extra): completions and chat carry the n best beams as the
offline search finds them, with usage and logprobs, and /metrics counts the search as one request; streamed, each beam comes whole in one chunk; what beam search
does not take is a 400 naming the field; a client that hangs up mid-search stops it and leaves no KV held."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve import LLM, SamplingParams
from llmserve.engine.async_llm import AsyncLLM
from tests.server.conftest import MODEL_NAME

PROMPT = [5, 77, 301, 12, 640, 9, 18, 420]
BEAMS = {"use_beam_search": True, "n": 3, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def offline_beams(tiny_llama_dir) -> list[list[int]]:
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, max_model_len=256)
    out = llm.generate([PROMPT], SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True,
                                                use_beam_search=True))[0]
    return [o.token_ids for o in out.outputs]


def _post(live_server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{live_server.base_url}{path}", json={"model": MODEL_NAME, **body}, timeout=60)


def _finished_requests(live_server) -> float:
    text = httpx.get(f"{live_server.base_url}/metrics").text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "vllm:request_success_total")


def test_a_completion_has_the_best_beams_with_usage_and_logprobs(live_server, offline_beams):
    finished = _finished_requests(live_server)
    response = _post(live_server, "/v1/completions", {"prompt": PROMPT, "logprobs": 2, **BEAMS})
    assert response.status_code == 200, response.text
    body = response.json()
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert [c["token_ids"] for c in choices] == offline_beams
    assert len({c["text"] for c in choices}) == 3 and all(c["finish_reason"] == "length" for c in choices)
    assert all(len(c["logprobs"]["token_logprobs"]) == 8 for c in choices)
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in choices]
    assert sums == sorted(sums, reverse=True)  # best first (one length: the score is the sum)
    assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 24, "total_tokens": len(PROMPT) + 24,
                             **{k: v for k, v in body["usage"].items() if k not in
                                ("prompt_tokens", "completion_tokens", "total_tokens")}}
    assert live_server.idle_stats().num_used_blocks == 0
    assert _finished_requests(live_server) == finished + 1  # the search, not its 8 x 3 one-token steps


def test_streamed_each_beam_comes_whole_in_one_chunk(live_server, offline_beams):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "stream": True, "stream_options": {"include_usage": True}, **BEAMS}
    by_choice: dict[int, list[dict]] = {}
    usage = None
    with httpx.stream("POST", f"{live_server.base_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: "):])
                for choice in chunk["choices"]:
                    by_choice.setdefault(choice["index"], []).append(choice)
                usage = chunk.get("usage") or usage
    assert [[c["token_ids"] for c in by_choice[i] if c.get("token_ids")] for i in range(3)] == [[b] for b in offline_beams]
    assert all(by_choice[i][-1]["finish_reason"] == "length" for i in range(3))
    assert usage["completion_tokens"] == 24


def test_a_chat_completion_has_n_beams(live_server):
    response = _post(live_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Name a colour."}], "use_beam_search": True, "n": 2,
        "max_tokens": 6, "length_penalty": 0.5,
    })
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert all(c["message"]["role"] == "assistant" and c["finish_reason"] in ("stop", "length") for c in choices)
    assert response.json()["usage"]["completion_tokens"] >= 2


@pytest.mark.parametrize("extra, param", [
    ({"temperature": 0.8}, "temperature"),
    ({"stop": ["\n"]}, "stop"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"n": 11}, "n"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"echo": True, "logprobs": 1}, "echo"),  # the prompt's logprobs, which beam search does not report
])
def test_what_beam_search_does_not_take_is_a_400_naming_it(live_server, extra, param):
    response = _post(live_server, "/v1/completions", {"prompt": PROMPT, **BEAMS, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_a_client_that_hangs_up_stops_the_search(live_server):
    engine = live_server.engine
    before = live_server.idle_stats().num_requests_added
    aborted = engine.num_aborted
    body = {"model": MODEL_NAME, "prompt": PROMPT, "stream": True, **BEAMS, "n": 4, "max_tokens": 400}

    async def main() -> None:
        async with httpx.AsyncClient(base_url=live_server.base_url, timeout=60) as http:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                while (await live_server.ask_async(AsyncLLM.stats)).num_requests_added < before + 8:
                    pass  # two steps of four beams in: each answer comes from the engine core, between its steps
            # leaving the block closed the connection mid-search
            while engine.num_aborted == aborted:
                await live_server.ask_async(AsyncLLM.stats)

    asyncio.run(main())
    stats = live_server.idle_stats()
    assert stats.num_used_blocks == 0 and stats.num_running == 0
    assert stats.num_requests_added - before < 4 * 400  # stopped long before its 400 steps
    assert _post(live_server, "/v1/completions", {"prompt": PROMPT, **BEAMS}).status_code == 200
