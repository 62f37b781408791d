"""/v1/completions with echo and logprobs (the prompt's tokens first, the first one's logprob null),
vLLM's prompt_logprobs on completions and chat, and truncate_prompt_tokens, against transformers'
float32 log_softmax on the same weights."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests import hf_reference
from tests.server.conftest import MODEL_NAME

PROMPT = [5, 77, 301, 12, 640, 9, 18, 420]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    return hf_reference.load_model(tiny_llama_dir)


@torch.no_grad()
def _prompt_logprobs(model, token_ids: list[int]) -> list[float]:
    logprobs = torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)
    return [float(logprobs[i - 1, token_ids[i]]) for i in range(1, len(token_ids))]


def _post(live_server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{live_server.base_url}{path}", json={"model": MODEL_NAME, **body}, timeout=60)


def test_echo_with_logprobs_scores_the_prompt_then_the_completion(live_server, reference):
    response = _post(live_server, "/v1/completions", {
        "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
    })
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert "prompt_logprobs" not in choice
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(PROMPT) + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:len(PROMPT)] == pytest.approx(_prompt_logprobs(reference, PROMPT), abs=2e-4)
    for top in logprobs["top_logprobs"][1:]:
        assert 1 <= len(top) <= 2
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0
    assert [b - a for a, b in zip(offsets, offsets[1:], strict=False)] == [len(t) for t in logprobs["tokens"][:-1]]
    # The generated tokens' logprobs are the same with or without echo.
    plain = _post(live_server, "/v1/completions", {
        "prompt": PROMPT, "logprobs": 2, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
    }).json()["choices"][0]
    assert plain["text"] and choice["text"].endswith(plain["text"])
    assert logprobs["tokens"][len(PROMPT):] == plain["logprobs"]["tokens"]
    assert logprobs["token_logprobs"][len(PROMPT):] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)
    assert live_server.idle_stats().num_used_blocks == 0


def test_prompt_logprobs_in_vllm_shape_on_completions_and_chat(live_server, reference):
    response = _post(live_server, "/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 1, "max_tokens": 2})
    assert response.status_code == 200, response.text
    prompt_logprobs = response.json()["choices"][0]["prompt_logprobs"]
    assert len(prompt_logprobs) == len(PROMPT) and prompt_logprobs[0] is None
    for token, entry, expected in zip(PROMPT[1:], prompt_logprobs[1:], _prompt_logprobs(reference, PROMPT),
                                      strict=True):
        assert entry[str(token)]["logprob"] == pytest.approx(expected, abs=2e-4)
        assert set(entry[str(token)]) == {"logprob", "rank", "decoded_token"}
        assert 1 <= len(entry) <= 2 and any(v["rank"] == 1 for v in entry.values())

    messages = [{"role": "user", "content": "hello"}]
    chat = _post(live_server, "/v1/chat/completions", {"messages": messages, "prompt_logprobs": 0, "max_tokens": 2})
    assert chat.status_code == 200, chat.text
    body = chat.json()
    num_prompt = body["usage"]["prompt_tokens"]
    assert len(body["prompt_logprobs"]) == num_prompt and body["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in body["prompt_logprobs"][1:])
    plain = _post(live_server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2}).json()
    assert "prompt_logprobs" not in plain


def test_truncate_prompt_tokens_on_both_endpoints(live_server):
    body = {"prompt": list(range(3, 40)), "truncate_prompt_tokens": 10, "max_tokens": 1, "echo": True,
            "logprobs": 0}
    response = _post(live_server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 10
    assert len(response.json()["choices"][0]["logprobs"]["tokens"]) == 11
    chat = _post(live_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "a long enough message to cut"}], "truncate_prompt_tokens": 4,
        "max_tokens": 1,
    })
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == 4


def _streamed_choice(live_server, body: dict) -> dict:
    """The choice a stream's chunks add up to: text joined, logprobs arrays joined, prompt_logprobs once."""
    joined: dict = {"text": "", "logprobs": {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}}
    payload = {"model": MODEL_NAME, "stream": True, **body}
    with httpx.stream("POST", f"{live_server.base_url}/v1/completions", json=payload, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                joined["text"] += choice["text"]
                for field, values in (choice.get("logprobs") or {}).items():
                    joined["logprobs"][field].extend(values)
                if "prompt_logprobs" in choice:
                    assert "prompt_logprobs" not in joined  # it comes once, with the first chunk
                    joined["prompt_logprobs"] = choice["prompt_logprobs"]
                joined["finish_reason"] = choice["finish_reason"]
    return joined


def test_echo_logprobs_and_prompt_logprobs_stream_as_they_answer(live_server):
    body = {"prompt": PROMPT, "echo": True, "logprobs": 2, "prompt_logprobs": 1, "max_tokens": 5,
            "temperature": 0, "ignore_eos": True}
    whole = _post(live_server, "/v1/completions", body).json()["choices"][0]
    streamed = _streamed_choice(live_server, body)
    assert streamed["text"] == whole["text"] and streamed["finish_reason"] == whole["finish_reason"]
    assert streamed["logprobs"]["tokens"] == whole["logprobs"]["tokens"]
    assert streamed["logprobs"]["text_offset"] == whole["logprobs"]["text_offset"]
    assert streamed["logprobs"]["token_logprobs"][0] is None
    assert streamed["logprobs"]["token_logprobs"][1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:],
                                                                       abs=1e-5)
    assert streamed["prompt_logprobs"] == whole["prompt_logprobs"]


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt": "hi", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
])
def test_bad_prompt_logprob_requests_are_400s(live_server, body, param):
    response = _post(live_server, "/v1/completions", body)
    assert response.status_code == 400, response.text
    assert param in response.text
