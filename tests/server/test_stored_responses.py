"""Stored Responses API responses over HTTP, in `llmserve serve`'s platform and in `llmserve gateway`'s: a
response is kept for its key unless `store: false`, read back and deleted by id, its input items listed, and
`previous_response_id` continues its conversation exactly as the chat completion of the whole conversation. A
background response is answered queued, polled to its end, and cancelled while it runs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.responses import Response as FastAPIResponse
from openai.types.responses import Response

from llmserve.engine.async_llm import AsyncLLM
from llmserve.platform.responses import ResponseStore
from llmserve.server.gateway import Platform
from llmserve.server.protocol import ChatCompletionRequest
from llmserve.server.responses_api import Storage, answer
from llmserve.server.responses_protocol import ResponsesRequest
from llmserve.store.db import open_database
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
        refused = client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "conversation": conversation,
                                                     "previous_response_id": first["id"]})
        assert refused.status_code == 400 and _error(refused)["param"] == "conversation", refused.text
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
                refused = client.post(f"{path}/cancel")  # not made in background
                assert refused.status_code == 400 and "background" in _error(refused)["message"]
                streamed = client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 4,
                                                              "background": True, "stream": True})
                sent = _events(iter(streamed.text.splitlines()))
                again = client.get(f"/v1/responses/{sent[0]['response']['id']}", params={"stream": "true",
                                                                                        "starting_after": 1})
                assert again.headers["content-type"].startswith("text/event-stream")
                assert _events(iter(again.text.splitlines())) == sent[2:]
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


def _polled(server: PlatformServer, client: httpx.Client, response_id: str) -> dict:
    """The background response, read back until it has ended."""
    latest: list[dict] = []

    def ended() -> bool:
        latest.append(client.get(f"/v1/responses/{response_id}").json())
        return latest[-1]["status"] not in ("queued", "in_progress")

    assert server.wait_until(ended, timeout=60), latest[-1]
    Response.model_validate(latest[-1])
    return latest[-1]


def _generating(server: PlatformServer) -> bool:
    """Whether the engine is running a request now."""
    assert server.loop is not None
    return asyncio.run_coroutine_threadsafe(server.engine.stats(), server.loop).result(timeout=30).num_running > 0


def _comparable(response: dict) -> dict:
    """A response without what two answers of the same request never share: ids, times, the prefix cache's hits."""
    output = [{k: v for k, v in item.items() if k != "id"} for item in response["output"]]
    usage = {k: v for k, v in response["usage"].items() if k != "input_tokens_details"}
    return {**response, "id": None, "created_at": None, "output": output, "usage": usage}


def test_a_background_response_is_polled_to_the_answer_of_the_same_request(server: PlatformServer) -> None:
    body = {"input": "What is two and two?", "instructions": "Answer briefly."}
    with server.client() as client:
        answered = _create(client, **body)
        queued = _create(client, **body, background=True)
        assert (queued["status"], queued["output"], queued["usage"], queued["background"]) == ("queued", [], None, True)
        finished = _polled(server, client, queued["id"])
        assert _comparable(finished) == _comparable(answered) | {"background": True}
        assert _text(finished) == _text(answered) and answered["background"] is False
        assert (finished["id"], finished["created_at"]) == (queued["id"], queued["created_at"])
        conversation = client.post("/v1/conversations", json={}).json()["id"]
        in_conversation = _polled(server, client, _create(client, input="Hi", conversation=conversation,
                                                          background=True)["id"])
        assert in_conversation["status"] in ("completed", "incomplete")
        stored = client.get(f"/v1/conversations/{conversation}/messages", params={"order": "asc"}).json()["data"]
        assert [(m["role"], m["content"]) for m in stored] == [("user", "Hi"), ("assistant", _text(in_conversation))]
    assert server.idle_stats().num_used_blocks == 0


def test_cancelling_a_background_response_aborts_its_run(server: PlatformServer) -> None:
    _, alice = server.new_key("alice")
    _, bob = server.new_key("bob")
    aborted = server.engine.num_aborted
    with server.client(alice) as client:
        # at temperature 0 the tiny model writes this to its 450th token (a good half second): cancelled before
        queued = _create(client, input="List every prime number.", max_output_tokens=450, background=True)
        assert server.wait_until(lambda: _generating(server))
        path = f"/v1/responses/{queued['id']}/cancel"
        cancelled = client.post(path)
        assert cancelled.status_code == 200, cancelled.text
        assert cancelled.json() | {"status": None} == {**queued, "status": None}
        assert cancelled.json()["status"] == "cancelled"
        assert server.wait_until(lambda: server.engine.num_aborted > aborted)
        assert server.idle_stats().num_used_blocks == 0
        assert client.get(f"/v1/responses/{queued['id']}").json() == cancelled.json()
        assert client.post(path).json() == cancelled.json()  # idempotent
        foreground = _create(client, input="Hello")
        refused = client.post(f"/v1/responses/{foreground['id']}/cancel")
        assert refused.status_code == 400 and "background" in _error(refused)["message"]
    with server.client(bob) as client:
        foreign = client.post(path)
        assert foreign.status_code == 404 and _error(foreign)["code"] == "response_not_found"


def test_deleting_a_running_background_response_aborts_its_run(server: PlatformServer) -> None:
    aborted = server.engine.num_aborted
    with server.client() as client:
        queued = _create(client, input="List every prime number.", max_output_tokens=450, background=True)
        assert server.wait_until(lambda: _generating(server))
        deleted = client.delete(f"/v1/responses/{queued['id']}")
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        assert server.wait_until(lambda: server.engine.num_aborted > aborted)
        assert not server.platform.background  # its task has ended
        gone = client.get(f"/v1/responses/{queued['id']}")
        assert gone.status_code == 404 and _error(gone)["code"] == "response_not_found"
    assert server.idle_stats().num_used_blocks == 0


def test_a_cancel_stored_by_another_process_outlives_the_run_here(server: PlatformServer) -> None:
    """Another gateway instance answered the cancel (stored, its task not there to stop): the run here goes on to
    its end, and leaves the response cancelled."""
    with server.client() as client:
        queued = _create(client, input="List every prime number.", max_output_tokens=450, background=True)
        assert server.wait_until(lambda: _generating(server))
        assert server.platform.responses is not None
        assert server.platform.responses.replace_unfinished(None, {**queued, "status": "cancelled"})
        assert server.wait_until(lambda: not server.platform.background)  # the run here has ended
        assert client.get(f"/v1/responses/{queued['id']}").json() == {**queued, "status": "cancelled"}
    assert server.idle_stats().num_used_blocks == 0


def test_background_responses_are_stored_and_only_theirs_are_streamed_again(server: PlatformServer) -> None:
    with server.client() as client:
        refused = client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "background": True, "store": False})
        assert refused.status_code == 400 and _error(refused)["param"] == "store", refused.text
        polled = _create(client, input="Hi", background=True)
        foreground = _create(client, input="Hi")
        for response in (polled, foreground):
            not_buffered = client.get(f"/v1/responses/{response['id']}", params={"stream": "true"})
            assert not_buffered.status_code == 400 and _error(not_buffered)["param"] == "stream", not_buffered.text
        stray = client.get(f"/v1/responses/{foreground['id']}", params={"starting_after": 3})
        assert stray.status_code == 400 and _error(stray)["param"] == "starting_after"
        unknown = client.get("/v1/responses/resp_nope", params={"stream": "true"})
        assert unknown.status_code == 404 and _error(unknown)["code"] == "response_not_found"
        _polled(server, client, polled["id"])


def _events(lines: Iterator[str], until: int | None = None) -> list[dict]:
    """The SSE events' data (each checked to carry its sequence number as its id), up to sequence number `until`."""
    events, event_id = [], None
    for line in lines:
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: {"):
            events.append(json.loads(line[6:]))
            assert events[-1]["sequence_number"] == event_id
            if events[-1]["sequence_number"] == until:
                break
    return events


def test_a_streamed_background_response_outlives_its_client_and_is_followed_again(server: PlatformServer) -> None:
    """OpenAI's resume of a dropped stream: the client reads a few events and leaves; the response runs on; GET
    ?stream=true&starting_after=N gives the events after N to the end, and what they add up to is stored."""
    body = {"model": MODEL, "temperature": 0, "max_output_tokens": 12, "input": "Count to ten.",
            "background": True, "stream": True}
    with server.client() as client:
        reference = _create(client, **{k: v for k, v in body.items() if k not in ("background", "stream")})
        with client.stream("POST", "/v1/responses", json=body) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
            first = _events(response.iter_lines(), until=3)  # then the connection closes
        response_id = first[0]["response"]["id"]
        assert [e["type"] for e in first[:2]] == ["response.created", "response.in_progress"]
        assert first[0]["response"]["background"] is True
        finished = _polled(server, client, response_id)
        with client.stream("GET", f"/v1/responses/{response_id}",
                           params={"stream": "true", "starting_after": 3}) as again:
            assert again.status_code == 200
            rest = _events(again.iter_lines())
        assert [e["sequence_number"] for e in first + rest] == list(range(len(first) + len(rest)))
        assert rest[-1]["type"] == f"response.{finished['status']}" and rest[-1]["response"] == finished
        assert _comparable(finished) == _comparable(reference) | {"background": True}
        text = "".join(e["delta"] for e in first + rest if e["type"] == "response.output_text.delta")
        assert text == _text(finished)
        whole = client.get(f"/v1/responses/{response_id}", params={"stream": "true"})
        assert [e["sequence_number"] for e in _events(iter(whole.text.splitlines()))] == list(range(len(first + rest)))
        sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        resumed = list(sdk.responses.retrieve(response_id, stream=True, starting_after=3))
        assert [event.model_dump(mode="json", exclude_unset=True) for event in resumed] == rest
    assert server.idle_stats().num_used_blocks == 0


def test_cancelling_a_streamed_background_response_ends_its_stream(server: PlatformServer) -> None:
    aborted = server.engine.num_aborted
    body = {"model": MODEL, "temperature": 0, "max_output_tokens": 450, "input": "List every prime number.",
            "background": True, "stream": True}
    with server.client() as client, client.stream("POST", "/v1/responses", json=body) as response:
        lines = response.iter_lines()
        [created] = _events(lines, until=0)
        response_id = created["response"]["id"]
        assert server.wait_until(lambda: _generating(server))
        not_here = client.delete(f"/v1/streams/{response_id}")  # a resumable stream, but the response's to stop
        assert not_here.status_code == 400 and "/cancel" in _error(not_here)["message"]
        cancelled = client.post(f"/v1/responses/{response_id}/cancel")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        rest = _events(lines)  # the stream ends
        assert all(e["type"] not in ("response.completed", "response.incomplete") for e in rest)
        assert server.wait_until(lambda: server.engine.num_aborted > aborted)
        assert client.get(f"/v1/responses/{response_id}").json()["status"] == "cancelled"
    assert server.idle_stats().num_used_blocks == 0


def test_a_background_response_whose_chat_is_refused_in_its_run_fails(server: PlatformServer) -> None:
    """More output tokens than the context window holds: chat refuses the run (a 400 to a request in the
    foreground), which the background response is answered before."""
    with server.client() as client:
        queued = _create(client, input="Hi", max_output_tokens=2000, background=True)
        failed = _polled(server, client, queued["id"])
        assert failed["status"] == "failed" and failed["output"] == [] and failed["usage"] is None
        foreground = client.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2000})
        assert foreground.status_code == 400 and _error(foreground)["code"] == "context_length_exceeded"
        # under the code of OpenAI's that says the request is at fault (its clients know no other), chat's message
        assert failed["error"] == {"code": "invalid_prompt", "message": _error(foreground)["message"]}
    assert server.idle_stats().num_used_blocks == 0


def test_the_platforms_shutdown_fails_the_background_responses_still_running(tmp_path: Path) -> None:
    """A run that never ends: answered queued, in progress once its task runs, and failed when the platform
    closes (at the server's shutdown), its task gone."""
    database = open_database(f"sqlite:///{tmp_path / 'platform.db'}")
    platform = Platform(responses=ResponseStore(database), database=database)
    storage = Storage(platform.responses, None, running=platform.background)
    chat_called = asyncio.Event()

    async def chat_forever(chat: ChatCompletionRequest, payload: dict) -> FastAPIResponse:
        chat_called.set()
        await asyncio.Event().wait()
        raise AssertionError("never reached")

    async def run_until_shutdown() -> list[dict]:
        """The response as answered, while it runs, and once the platform has closed (its tasks all ended)."""
        body = ResponsesRequest(model=MODEL, input="Hi", background=True)
        queued = json.loads(bytes((await answer(body, chat_forever, storage)).body))
        await chat_called.wait()
        running = await asyncio.to_thread(platform.responses.get, None, queued["id"])
        await platform.aclose()
        assert platform.background == {}
        return [queued, running, await asyncio.to_thread(platform.responses.get, None, queued["id"])]

    queued, running, closed = asyncio.run(run_until_shutdown())
    assert queued["status"] == "queued" and running == {**queued, "status": "in_progress"}
    assert closed == {**queued, "status": "failed", "error": {
        "code": "server_error", "message": "The server shut down before the response was finished."}}
