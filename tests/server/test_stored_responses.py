"""Stored Responses API responses over HTTP, in `llmserve serve`'s platform and in `llmserve gateway`'s: a
response is kept for its key unless `store: false`, read back and deleted by id, its input items listed, and
`previous_response_id` continues its conversation exactly as the chat completion of the whole conversation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.responses import Response

from llmserve.engine.async_llm import AsyncLLM
from tests.server.platform_fixtures import (
    MODEL,
    MODES,
    PlatformServer,
    serve_platform,
    tiny_engine,  # noqa: F401 - a fixture
)


@pytest.fixture(params=MODES)
def server(tiny_engine: AsyncLLM, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[PlatformServer]:  # noqa: F811
    yield from serve_platform(tiny_engine, tmp_path, mode=request.param)


def _create(client: httpx.Client, **body) -> dict:
    response = client.post("/v1/responses", json={"model": MODEL, "temperature": 0, "max_output_tokens": 6, **body})
    assert response.status_code == 200, response.text
    Response.model_validate(response.json())
    return response.json()


def _streamed(client: httpx.Client, **body) -> dict:
    payload = {"model": MODEL, "temperature": 0, "max_output_tokens": 6, "stream": True, **body}
    response = client.post("/v1/responses", json=payload)
    assert response.status_code == 200, response.text
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")][-1]["response"]


def _text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"])


def _error(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_a_continued_response_is_the_chat_completion_of_its_whole_conversation(server: PlatformServer) -> None:
    _, secret = server.new_key("alice")
    with server.client(secret) as client:
        first = _create(client, input="What is two and two?", instructions="Answer briefly.")
        assert first["store"] is True and first["previous_response_id"] is None
        second = _create(client, input="And three and three?", previous_response_id=first["id"])
        third = _streamed(client, input=[{"role": "user", "content": "Thanks!"}], previous_response_id=second["id"])
        chat = client.post("/v1/chat/completions", json={
            "model": MODEL, "temperature": 0, "max_completion_tokens": 6, "messages": [
                # instructions do not carry over to the next response, as in OpenAI's API
                {"role": "user", "content": "What is two and two?"},
                {"role": "assistant", "content": _text(first)},
                {"role": "user", "content": "And three and three?"},
                {"role": "assistant", "content": _text(second)},
                {"role": "user", "content": "Thanks!"},
            ]}).json()
        assert _text(third) == chat["choices"][0]["message"]["content"]
        assert third["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
        assert (second["previous_response_id"], third["previous_response_id"]) == (first["id"], second["id"])
        for response in (first, second, third):  # read back as answered (the streamed one: its final event's)
            assert client.get(f"/v1/responses/{response['id']}").json() == response
    assert server.idle_stats().num_used_blocks == 0


def test_input_items_are_the_requests_own_a_page_at_a_time(server: PlatformServer) -> None:
    with server.client() as client:
        first = _create(client, input="Hello")
        items = [{"role": "user", "content": f"question {i}"} for i in range(3)]
        second = _create(client, input=items, previous_response_id=first["id"])
        page = client.get(f"/v1/responses/{second['id']}/input_items", params={"limit": 2}).json()
        assert [item["content"] for item in page["data"]] == ["question 2", "question 1"] and page["has_more"]
        rest = client.get(f"/v1/responses/{second['id']}/input_items",
                          params={"limit": 2, "after": page["last_id"]}).json()
        assert [item["content"] for item in rest["data"]] == ["question 0"] and not rest["has_more"]
        assert all(item["type"] == "message" and item["id"].startswith("msg_") for item in page["data"] + rest["data"])
        whole = client.get(f"/v1/responses/{first['id']}/input_items", params={"order": "asc"}).json()["data"]
        assert [item["content"] for item in whole] == [[{"type": "input_text", "text": "Hello"}]]
        unknown = client.get(f"/v1/responses/{second['id']}/input_items", params={"after": "msg_nope"})
        assert unknown.status_code == 400 and _error(unknown)["param"] == "after"


def test_a_response_is_its_keys_alone_and_store_false_keeps_nothing(server: PlatformServer) -> None:
    _, alice = server.new_key("alice")
    _, bob = server.new_key("bob")
    with server.client(alice) as client:
        mine = _create(client, input="Hello")
        unstored = _create(client, input="Hello", store=False)
        assert unstored["store"] is False
        assert client.get(f"/v1/responses/{unstored['id']}").status_code == 404
    with server.client(bob) as client:
        for response in (client.get(f"/v1/responses/{mine['id']}"), client.delete(f"/v1/responses/{mine['id']}"),
                         client.get(f"/v1/responses/{mine['id']}/input_items")):
            assert response.status_code == 404 and _error(response)["code"] == "response_not_found"
        foreign = client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "previous_response_id": mine["id"]})
        assert foreign.status_code == 404
        assert _error(foreign) | {"message": ""} == {"message": "", "type": "not_found_error",
                                                      "param": "previous_response_id",
                                                      "code": "previous_response_not_found"}
    with server.client(alice) as client:
        assert client.get(f"/v1/responses/{mine['id']}").status_code == 200


def test_a_deleted_response_is_gone_and_its_followers_cannot_continue(server: PlatformServer) -> None:
    with server.client() as client:
        first = _create(client, input="One")
        second = _create(client, input="Two", previous_response_id=first["id"])
        deleted = client.delete(f"/v1/responses/{first['id']}")
        assert deleted.json() == {"id": first["id"], "object": "response.deleted", "deleted": True}
        assert client.get(f"/v1/responses/{first['id']}").status_code == 404
        assert client.get(f"/v1/responses/{second['id']}").status_code == 200
        broken = client.post("/v1/responses", json={"model": MODEL, "input": "Three",
                                                    "previous_response_id": second["id"]})
        assert broken.status_code == 400 and _error(broken)["param"] == "previous_response_id"
        assert first["id"] in _error(broken)["message"]
    assert server.idle_stats().num_used_blocks == 0


def test_truncation_auto_drops_a_long_chains_oldest_turns(server: PlatformServer) -> None:
    """512 tokens of context: two turns of ~200 tokens fit, three do not. "auto" leaves out the oldest turn (the
    chat of the remaining ones), "disabled" is the usual 400; chat's own `truncation` does the same."""
    long = "word " * 100
    with server.client() as client:
        first = _create(client, input=long)
        second = _create(client, input=long, previous_response_id=first["id"])
        body = {"model": MODEL, "temperature": 0, "max_output_tokens": 6, "input": long,
                "previous_response_id": second["id"]}
        for stream in (False, True):  # in the gateway the replica's 400 comes back as an answer, not an exception
            whole = client.post("/v1/responses", json={**body, "stream": stream})
            assert whole.status_code == 400 and _error(whole)["param"] == "input", whole.text
        cut = _create(client, **{**body, "truncation": "auto"})
        kept = [{"role": "user", "content": long}, {"role": "assistant", "content": _text(second)},
                {"role": "user", "content": long}]
        chat = client.post("/v1/chat/completions", json={"model": MODEL, "temperature": 0, "max_completion_tokens": 6,
                                                         "messages": kept}).json()
        assert cut["truncation"] == "auto" and _text(cut) == chat["choices"][0]["message"]["content"]
        assert cut["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]
        every_turn = [{"role": "user", "content": long}, {"role": "assistant", "content": _text(first)}, *kept]
        chat_cut = client.post("/v1/chat/completions", json={
            "model": MODEL, "temperature": 0, "max_completion_tokens": 6, "messages": every_turn, "truncation": "auto"})
        assert chat_cut.status_code == 200 and chat_cut.json()["usage"] == chat["usage"]
    assert server.idle_stats().num_used_blocks == 0


def test_a_conversation_gives_each_response_the_turns_before_it(server: PlatformServer) -> None:
    """`conversation` (an id, or {"id"}): its messages before the input, after the instructions (which it does not
    keep); the input's messages and the output text appended. Its key's alone; one continuation at a time."""
    _, alice = server.new_key("alice")
    _, bob = server.new_key("bob")
    with server.client(alice) as client:
        conversation = client.post("/v1/conversations", json={}).json()["id"]
        first = _create(client, input="What is two and two?", instructions="Answer briefly.", conversation=conversation)
        second = _streamed(client, input=[{"role": "user", "content": "And three?"}], instructions="Answer briefly.",
                           conversation={"id": conversation})
        assert first["conversation"] == second["conversation"] == {"id": conversation}
        turns = [("user", "What is two and two?"), ("assistant", _text(first)), ("user", "And three?"),
                 ("assistant", _text(second))]
        stored = client.get(f"/v1/conversations/{conversation}/messages", params={"order": "asc"}).json()["data"]
        assert [(m["role"], m["content"]) for m in stored] == turns
        chat = client.post("/v1/chat/completions", json={
            "model": MODEL, "temperature": 0, "max_completion_tokens": 6,
            "messages": [{"role": "system", "content": "Answer briefly."},
                         *({"role": role, "content": content} for role, content in turns[:3])]}).json()
        assert _text(second) == chat["choices"][0]["message"]["content"]
        assert second["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"] > first["usage"]["input_tokens"]
        for body, param in (({"previous_response_id": first["id"]}, "conversation"),
                            ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "conversation")):
            refused = client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "conversation": conversation,
                                                         **body})
            assert refused.status_code == 400 and _error(refused)["param"] == param, refused.text
    with server.client(bob) as client:
        foreign = client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "conversation": conversation})
        assert foreign.status_code == 404
        assert _error(foreign) | {"message": ""} == {"message": "", "type": "not_found_error", "param": "conversation",
                                                      "code": "conversation_not_found"}
    assert server.idle_stats().num_used_blocks == 0


def test_truncation_auto_drops_a_conversations_oldest_turns(server: PlatformServer) -> None:
    """512 tokens of context: a stored conversation of two ~200-token turns and a third as input do not fit;
    "auto" leaves out the oldest stored turn (the chat of the rest), "disabled" is the usual 400."""
    long = "word " * 100
    with server.client() as client:
        seeded = [{"role": "user", "content": long}, {"role": "assistant", "content": "One."},
                  {"role": "user", "content": long}, {"role": "assistant", "content": "Two."}]
        conversation = client.post("/v1/conversations", json={"messages": seeded}).json()["id"]
        body = {"model": MODEL, "temperature": 0, "max_output_tokens": 6, "input": long, "conversation": conversation}
        whole = client.post("/v1/responses", json=body)
        assert whole.status_code == 400 and _error(whole)["param"] == "input", whole.text
        cut = _create(client, **{**body, "truncation": "auto"})
        chat = client.post("/v1/chat/completions", json={"model": MODEL, "temperature": 0, "max_completion_tokens": 6,
                                                         "messages": [*seeded[2:], {"role": "user", "content": long}]})
        assert _text(cut) == chat.json()["choices"][0]["message"]["content"]
        assert cut["usage"]["input_tokens"] == chat.json()["usage"]["prompt_tokens"]
    assert server.idle_stats().num_used_blocks == 0


def test_a_gateway_without_a_platform_reads_and_deletes_what_its_replicas_stored(
    tiny_engine: AsyncLLM, tmp_path: Path  # noqa: F811
) -> None:
    """The replica keeps the responses; the gateway (no platform) passes GET and DELETE on to the first pool whose
    replica knows the id, passing over one that answers 404 (here a healthy app that knows nothing)."""
    from fastapi import FastAPI

    from llmserve.gateway.app import build_gateway_app
    from tests.server.conftest import start_server

    with contextmanager(serve_platform)(tiny_engine, tmp_path) as replica:
        knows_nothing = FastAPI()
        knows_nothing.get("/health")(lambda: {"status": "ok"})
        stranger, stranger_thread, stranger_url, _ = start_server(knows_nothing)
        gateway, gateway_thread, gateway_url, _ = start_server(
            build_gateway_app({"other": [stranger_url], MODEL: [replica.base_url]}))
        try:
            with httpx.Client(base_url=gateway_url, timeout=60) as client:
                made = _create(client, input="Once upon a time")
                path = f"/v1/responses/{made['id']}"
                read = client.get(path)
                assert read.status_code == 200 and read.json() == httpx.get(replica.base_url + path).json() == made
                items = client.get(f"{path}/input_items", params={"limit": 1})
                assert items.status_code == 200 and items.json() == httpx.get(
                    f"{replica.base_url}{path}/input_items", params={"limit": 1}).json()
                assert client.delete(path).json() == {"id": made["id"], "object": "response.deleted", "deleted": True}
                gone = client.get(path)
                assert gone.status_code == 404 and _error(gone)["code"] == "response_not_found"
        finally:
            for server, thread in ((gateway, gateway_thread), (stranger, stranger_thread)):
                server.should_exit = True
                thread.join(timeout=30)


def test_input_tokens_are_those_the_response_reads_after_its_stored_turns(server: PlatformServer) -> None:
    """POST /v1/responses/input_tokens (the SDK's `responses.input_tokens.count`) counts what the response made from
    the same request reads: its instructions, a previous response's turns or a stored conversation's messages, its
    input and its tools."""
    sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}}]
    with server.client() as client:
        first = _create(client, input="What is two and two?", instructions="Answer briefly.")
        follow_up = {"input": "And three and three?", "previous_response_id": first["id"], "instructions": "Be kind."}
        counted = sdk.responses.input_tokens.count(model=MODEL, **follow_up, tools=tools)
        assert counted.object == "response.input_tokens"
        assert counted.input_tokens == _create(client, **follow_up, tools=tools)["usage"]["input_tokens"]
        without_tools = sdk.responses.input_tokens.count(model=MODEL, **follow_up).input_tokens
        assert without_tools == _create(client, **follow_up)["usage"]["input_tokens"] < counted.input_tokens
        conversation = client.post("/v1/conversations", json={"messages": [
            {"role": "user", "content": "Name a lake."}, {"role": "assistant", "content": "Como."}]}).json()["id"]
        in_conversation = sdk.responses.input_tokens.count(model=MODEL, input="And a river?", conversation=conversation)
        assert in_conversation.input_tokens == _create(client, input="And a river?", conversation=conversation)[
            "usage"]["input_tokens"]
        unknown = client.post("/v1/responses/input_tokens", json={"model": MODEL, "input": "Hi",
                                                                   "previous_response_id": "resp_nope"})
        assert unknown.status_code == 404 and _error(unknown)["param"] == "previous_response_id"
        stray = client.post("/v1/responses/input_tokens", json={"model": MODEL, "input": "Hi", "stream": True})
        assert stray.status_code == 400 and _error(stray)["param"] == "stream"
