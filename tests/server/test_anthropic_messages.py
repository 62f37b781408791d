"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) driven by Anthropic's own client: a message
is the chat completion of the same conversation (its text, usage and stop reason), streamed or not; a stop
sequence is named and left out; tool calls and results go both ways; the count is the prompt's tokens; keys come
in `x-api-key`, through `llmserve gateway` too; what it cannot serve is a 400 naming it."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest

from llmserve.engine.async_llm import AsyncLLM
from tests.server.conftest import MODEL_NAME, LiveServer, serving
from tests.server.platform_fixtures import MODEL, MODES, serve_platform, tiny_engine  # noqa: F401 - a fixture

anthropic = pytest.importorskip("anthropic")

MESSAGES = [{"role": "user", "content": "Tell me about the weather"}]
GREEDY = {"temperature": 0}  # older clients' field (Claude Code sends it): Anthropic's newest client has none
SYSTEM = "You are brief."
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                            "required": ["city"],
                            "additionalProperties": False}}


def _client(base_url: str, key: str = "x") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=key, max_retries=0)


def _chat(server: LiveServer, max_tokens: int, **extra) -> dict:
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        return http.post("/v1/chat/completions", json={
            "model": MODEL_NAME, "messages": [{"role": "system", "content": SYSTEM}, *MESSAGES],
            "max_tokens": max_tokens, "temperature": 0, **extra}).json()


def test_a_message_is_the_chat_completion_of_the_same_conversation(live_server: LiveServer) -> None:
    chat = _chat(live_server, 12)
    message = _client(live_server.base_url).messages.create(model=MODEL_NAME, max_tokens=12, system=SYSTEM,
                                                            messages=MESSAGES, extra_body=GREEDY)
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == MODEL_NAME
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == chat["choices"][0]["message"]["content"]
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    usage = chat["usage"]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == usage["prompt_tokens"]
    assert message.usage.output_tokens == usage["completion_tokens"] == 12


def test_streamed_it_is_the_same_message_in_anthropics_events(live_server: LiveServer) -> None:
    client = _client(live_server.base_url)
    whole = client.messages.create(model=MODEL_NAME, max_tokens=12, system=SYSTEM, messages=MESSAGES, extra_body=GREEDY)
    with client.messages.stream(model=MODEL_NAME, max_tokens=12, system=SYSTEM, messages=MESSAGES,
                                extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    assert streamed.content[0].text == whole.content[0].text
    assert (streamed.stop_reason, streamed.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_ends_the_message_and_is_named(live_server: LiveServer, stream: bool) -> None:
    text = _chat(live_server, 24)["choices"][0]["message"]["content"]
    at = next(i for i in range(6, len(text) - 3) if text.find(text[i:i + 3]) == i and text[i:i + 3].strip())
    stop = text[at:at + 3]
    client = _client(live_server.base_url)
    request = dict(model=MODEL_NAME, max_tokens=24, system=SYSTEM, messages=MESSAGES, extra_body=GREEDY,
                   stop_sequences=[stop, "never-said"])
    if stream:
        with client.messages.stream(**request) as streaming:
            message = streaming.get_final_message()
    else:
        message = client.messages.create(**request)
    assert message.content[0].text == text[:at]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_is_called_and_its_result_read_back(live_server: LiveServer, stream: bool) -> None:
    client = _client(live_server.base_url)
    request = dict(model=MODEL_NAME, max_tokens=40, messages=MESSAGES, tools=[WEATHER],
                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    if stream:
        with client.messages.stream(**request) as streaming:
            message = streaming.get_final_message()
    else:
        message = client.messages.create(**request)
    calls = [block for block in message.content if block.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and isinstance(calls[0].input["city"], str)
    assert message.stop_reason == "tool_use"
    follow_up = [*MESSAGES, {"role": "assistant", "content": [block.model_dump() for block in message.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                               "content": "Sunny, 21 C"}, {"type": "text", "text": "And tomorrow?"}]}]
    answered = client.messages.create(model=MODEL_NAME, max_tokens=4, messages=follow_up, tools=[WEATHER])
    counted = client.messages.count_tokens(model=MODEL_NAME, messages=follow_up, tools=[WEATHER])
    assert counted.input_tokens == answered.usage.input_tokens + answered.usage.cache_read_input_tokens
    shorter = client.messages.count_tokens(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER])
    assert 0 < shorter.input_tokens < counted.input_tokens


def test_output_config_format_makes_the_reply_follow_the_schema(live_server: LiveServer) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    message = _client(live_server.base_url).messages.create(
        model=MODEL_NAME, max_tokens=40, messages=MESSAGES,
        output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(message.content[0].text), schema)


@pytest.fixture(scope="module")
def reasoning_server(tiny_qwen3_dir: Path) -> Iterator[LiveServer]:
    with serving(tiny_qwen3_dir, reasoning_parser="qwen3") as server:
        yield server


def test_thinking_turns_the_templates_thinking_on_or_off_and_caps_it(reasoning_server: LiveServer) -> None:
    """Qwen3's template closes an empty think block when thinking is off: the prompt is longer by it."""
    client = _client(reasoning_server.base_url)
    counts = {kind: client.messages.count_tokens(model=MODEL_NAME, messages=MESSAGES, thinking=thinking).input_tokens
              for kind, thinking in (("off", {"type": "disabled"}), ("on", {"type": "adaptive"}),
                                     ("capped", {"type": "enabled", "budget_tokens": 1024}))}
    default = client.messages.count_tokens(model=MODEL_NAME, messages=MESSAGES).input_tokens
    assert counts["on"] == counts["capped"] == default < counts["off"]
    for thinking, chat_fields in (({"type": "disabled"}, {"chat_template_kwargs": {"enable_thinking": False}}),
                                  ({"type": "enabled", "budget_tokens": 2}, {"thinking_token_budget": 2})):
        message = client.messages.create(model=MODEL_NAME, max_tokens=6, messages=MESSAGES, thinking=thinking,
                                         extra_body=GREEDY)
        with httpx.Client(base_url=reasoning_server.base_url, timeout=60) as http:
            chat = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 6,
                                                           "temperature": 0, **chat_fields}).json()
        assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
        assert "".join(block.text for block in message.content if block.type == "text") == (
            chat["choices"][0]["message"]["content"] or "")


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
     "messages[0].content[0].source"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "u"}}]}]},
     "messages"),  # not a data: or http(s) URL
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "text", "data": "d"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    # no reasoning parser: its replies have no thinking to cap
    ({"messages": MESSAGES, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.budget_tokens"),
    ({"messages": MESSAGES, "thinking": {"type": "enabled", "budget_tokens": -1}}, "thinking.budget_tokens"),
    ({"messages": MESSAGES, "thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"messages": MESSAGES, "thinking": {"type": "disabled", "budget_tokens": 5}}, "thinking.budget_tokens"),
    ({"messages": MESSAGES, "tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0].type"),
    ({"messages": MESSAGES, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"messages": MESSAGES, "temperature": 1.5}, "temperature"),
    ({"messages": MESSAGES, "container": "c"}, "container"),
    ({"messages": MESSAGES, "output_config": {"effort": "high"}}, "output_config.effort"),  # no template reads it
    ({"messages": MESSAGES, "output_config": {"format": {"type": "regex"}}}, "output_config.format"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id"),
])
def test_what_it_cannot_serve_is_a_400_naming_it(live_server: LiveServer, body: dict, param: str) -> None:
    answer = httpx.post(f"{live_server.base_url}/v1/messages", json={"model": MODEL_NAME, "max_tokens": 4, **body},
                        timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    with pytest.raises(anthropic.BadRequestError):
        _client(live_server.base_url).messages.create(model=MODEL_NAME, max_tokens=4, messages=body["messages"],
                                                      extra_body={k: v for k, v in body.items() if k != "messages"})
    assert httpx.post(f"{live_server.base_url}/v1/messages", json={"model": MODEL_NAME, "messages": MESSAGES},
                      timeout=60).status_code == 400  # max_tokens is required


@pytest.mark.parametrize("mode", MODES)
def test_a_key_in_x_api_key_is_metered_through_the_gateway_too(tiny_engine: AsyncLLM, tmp_path: Path,  # noqa: F811
                                                               mode: str) -> None:
    with contextlib.contextmanager(serve_platform)(tiny_engine, tmp_path, mode=mode) as server:
        key, secret = server.new_key("claude")
        with pytest.raises(anthropic.AuthenticationError):
            _client(server.base_url, "sk-wrong").messages.create(model=MODEL, max_tokens=4, messages=MESSAGES)
        client = _client(server.base_url, secret)
        message = client.messages.create(model=MODEL, max_tokens=5, messages=MESSAGES, extra_body=GREEDY)
        with client.messages.stream(model=MODEL, max_tokens=5, messages=MESSAGES, extra_body=GREEDY) as stream:
            streamed = stream.get_final_message()
        assert streamed.content[0].text == message.content[0].text
        counted = client.messages.count_tokens(model=MODEL, messages=MESSAGES)
        assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
        rows = server.wait_for_usage_rows(2)
        assert [(row.key_id, row.completion_tokens, row.status) for row in rows] == [(key.id, 5, "completed")] * 2


@pytest.mark.parametrize("mode", MODES)
def test_errors_are_in_anthropics_shape_wherever_they_come_from(tiny_engine: AsyncLLM, tmp_path: Path,  # noqa: F811
                                                                mode: str) -> None:
    """The key check's 401, the request's 400 (its param kept), an unknown batch's 404 and the rate limit's 429
    answer Anthropic's API as Anthropic does ({"type": "error", "error": {"type", "message"}}); OpenAI's API keeps
    OpenAI's shape."""
    with contextlib.contextmanager(serve_platform)(tiny_engine, tmp_path, mode=mode) as server:
        _, secret = server.new_key("claude", rpm=2)
        with pytest.raises(anthropic.AuthenticationError) as unknown_key:
            _client(server.base_url, "sk-wrong").messages.create(model=MODEL, max_tokens=4, messages=MESSAGES)
        headers = {"x-api-key": secret}
        bad = httpx.post(f"{server.base_url}/v1/messages", headers=headers, timeout=60,
                         json={"model": MODEL, "max_tokens": 4, "messages": MESSAGES, "temperature": 1.5})
        missing = httpx.get(f"{server.base_url}/v1/messages/batches/msgbatch_nope", headers=headers, timeout=60)
        for _ in range(3):  # past the key's 2 requests a minute
            limited = httpx.post(f"{server.base_url}/v1/messages", headers=headers, timeout=60,
                                 json={"model": MODEL, "max_tokens": 1, "messages": MESSAGES})
        chat = httpx.post(f"{server.base_url}/v1/chat/completions", headers={"authorization": f"Bearer {secret}"},
                          json={"model": MODEL, "messages": MESSAGES, "temperature": 3}, timeout=60)
    assert unknown_key.value.body["type"] == "error"
    assert unknown_key.value.body["error"]["type"] == "authentication_error"
    assert (bad.status_code, bad.json()["type"], bad.json()["error"]["type"], bad.json()["error"]["param"]) == (
        400, "error", "invalid_request_error", "temperature")
    assert (missing.status_code, missing.json()["error"]["type"]) == (404, "not_found_error")
    assert (limited.status_code, limited.json()["error"]["type"]) == (429, "rate_limit_error")
    assert limited.headers["retry-after"] and limited.headers["content-length"] == str(len(limited.content))
    assert chat.status_code in (400, 429) and "type" not in chat.json() and "message" in chat.json()["error"]
