"""Stored chat completions over HTTP, in `llmserve serve`'s platform and in `llmserve gateway`'s: a `store: true`
completion is kept for its key as the client got it (a streamed one as the whole completion it adds up to), listed by
model and metadata a page at a time, read back with its request's messages, its metadata replaced, and deleted; by
raw HTTP and by OpenAI's SDK. Without storage `store: true` is a 400, never a completion silently not kept."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion

from llmserve.engine.async_llm import AsyncLLM
from llmserve.server.app import build_app
from tests.server.conftest import app_serving
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


def _body(content: str = "Tell me a story.", **extra) -> dict:
    return {"model": MODEL, "temperature": 0, "max_completion_tokens": 6,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}], **extra}


def _create(client: httpx.Client, **body) -> dict:
    response = client.post("/v1/chat/completions", json=_body(**body))
    assert response.status_code == 200, response.text
    return response.json()


def _streamed_id(client: httpx.Client, **body) -> str:
    return _streamed_chunks(client, **body)[0]["id"]


def _streamed_chunks(client: httpx.Client, **body) -> list[dict]:
    response = client.post("/v1/chat/completions", json=_body(stream=True, **body))
    assert response.status_code == 200, response.text
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


def _error(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_a_stored_completion_is_read_back_as_answered_with_its_messages(server: PlatformServer) -> None:
    with server.client() as client:
        answered = _create(client, store=True, metadata={"topic": "stories"})
        stored = client.get(f"/v1/chat/completions/{answered['id']}").json()
        assert stored == {**answered, "metadata": {"topic": "stories"}}
        ChatCompletion.model_validate(stored)
        messages = client.get(f"/v1/chat/completions/{answered['id']}/messages").json()
        assert messages["data"] == [
            {"id": f"{answered['id']}-0", "role": "system", "content": "Be brief.", "content_parts": None},
            {"id": f"{answered['id']}-1", "role": "user", "content": "Tell me a story.", "content_parts": None},
        ]
        assert (messages["first_id"], messages["has_more"]) == (f"{answered['id']}-0", False)
        for unstored in (_create(client), _create(client, store=False)):
            assert client.get(f"/v1/chat/completions/{unstored['id']}").status_code == 404
        assert [c["id"] for c in client.get("/v1/chat/completions").json()["data"]] == [answered["id"]]
    assert server.idle_stats().num_used_blocks == 0


def test_a_streamed_completion_is_stored_as_the_completion_it_adds_up_to(server: PlatformServer) -> None:
    """Two choices with their logprobs, streamed: kept as the non-streamed request's answer."""
    extra = {"n": 2, "logprobs": True, "top_logprobs": 2}
    with server.client() as client:
        whole = _create(client, **extra)
        completion_id = _streamed_id(client, store=True, **extra)
        stored = client.get(f"/v1/chat/completions/{completion_id}").json()
    assert stored["choices"] == whole["choices"] and stored["usage"] == whole["usage"]
    assert (stored["id"], stored["object"], stored["model"], stored["metadata"]) == (
        completion_id, "chat.completion", whole["model"], {})
    assert [choice["message"]["content"] for choice in stored["choices"]] == [whole["choices"][0]["message"]["content"]] * 2


def test_streamed_tool_calls_are_stored_whole(server: PlatformServer) -> None:
    """A call's id and name come in its first delta, its arguments in pieces: stored, they are one call, as
    answered unstreamed, under the id its client was sent (the ids are each request's own)."""
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
        "required": ["zone"]}}}
    extra = {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "get_time"}},
             "max_completion_tokens": 60}
    with server.client() as client:
        whole = _create(client, **extra)["choices"][0]
        chunks = _streamed_chunks(client, store=True, **extra)
        stored = client.get(f"/v1/chat/completions/{chunks[0]['id']}").json()["choices"][0]
    [sent_id] = [d["id"] for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or [] if d.get("id")]
    [call] = stored["message"].pop("tool_calls")
    [expected] = whole["message"].pop("tool_calls")
    assert call.pop("id") == sent_id != expected.pop("id") and sent_id.startswith("call_")
    assert call == expected and json.loads(call["function"]["arguments"])["zone"] in range(-12, 13)
    assert stored == whole and stored["finish_reason"] == "tool_calls" and stored["message"]["content"] is None


def test_stored_completions_are_listed_by_model_and_metadata_a_page_at_a_time(server: PlatformServer) -> None:
    with server.client() as client:
        ids = [_create(client, store=True, metadata={"run": "a" if i < 3 else "b", "i": str(i)})["id"]
               for i in range(4)]
        page = client.get("/v1/chat/completions", params={"limit": 2}).json()
        assert [c["id"] for c in page["data"]] == ids[:2] and page["has_more"] and page["last_id"] == ids[1]
        rest = client.get("/v1/chat/completions", params={"limit": 2, "after": ids[1]}).json()
        assert [c["id"] for c in rest["data"]] == ids[2:] and not rest["has_more"]
        newest = client.get("/v1/chat/completions", params={"order": "desc", "limit": 1}).json()
        assert [c["id"] for c in newest["data"]] == [ids[3]]
        by_run = client.get("/v1/chat/completions", params={"metadata[run]": "a", "metadata[i]": "1"}).json()
        assert [c["id"] for c in by_run["data"]] == [ids[1]]
        assert client.get("/v1/chat/completions", params={"model": "another"}).json()["data"] == []
        assert len(client.get("/v1/chat/completions", params={"model": MODEL}).json()["data"]) == 4
        unknown = client.get("/v1/chat/completions", params={"after": "chatcmpl-nope"})
        assert unknown.status_code == 400 and _error(unknown)["param"] == "after"
        assert client.get("/v1/chat/completions", params={"limit": 101}).status_code == 400


def test_a_completion_is_its_keys_alone_its_metadata_replaced_and_deleted(server: PlatformServer) -> None:
    _, alice = server.new_key("alice")
    _, bob = server.new_key("bob")
    with server.client(alice) as client:
        mine = _create(client, store=True, metadata={"topic": "a"})["id"]
    with server.client(bob) as client:
        assert client.get("/v1/chat/completions").json()["data"] == []
        for response in (client.get(f"/v1/chat/completions/{mine}"), client.delete(f"/v1/chat/completions/{mine}"),
                         client.get(f"/v1/chat/completions/{mine}/messages"),
                         client.post(f"/v1/chat/completions/{mine}", json={"metadata": {"topic": "b"}})):
            assert response.status_code == 404 and _error(response)["code"] == "chat_completion_not_found"
    with server.client(alice) as client:
        updated = client.post(f"/v1/chat/completions/{mine}", json={"metadata": {"topic": "b", "more": "c"}})
        assert updated.status_code == 200 and updated.json()["metadata"] == {"topic": "b", "more": "c"}
        assert client.get("/v1/chat/completions", params={"metadata[topic]": "a"}).json()["data"] == []
        too_many = client.post(f"/v1/chat/completions/{mine}", json={"metadata": {str(i): "x" for i in range(17)}})
        assert too_many.status_code == 400 and _error(too_many)["param"] == "metadata"
        stray = client.post(f"/v1/chat/completions/{mine}", json={"metadata": {}, "model": MODEL})
        assert stray.status_code == 400 and _error(stray)["param"] == "model"
        deleted = client.delete(f"/v1/chat/completions/{mine}")
        assert deleted.json() == {"id": mine, "object": "chat.completion.deleted", "deleted": True}
        assert client.get(f"/v1/chat/completions/{mine}").status_code == 404


def test_openais_sdk_lists_reads_updates_and_deletes_stored_completions(server: PlatformServer) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    made = client.chat.completions.create(**_body(), store=True, metadata={"suite": "sdk"})
    client.chat.completions.create(**_body(content="Another one."), store=True, metadata={"suite": "other"})
    listed = client.chat.completions.list(metadata={"suite": "sdk"}, model=MODEL)
    assert [c.id for c in listed.data] == [made.id]
    assert client.chat.completions.retrieve(made.id).choices == made.choices
    assert [m.content for m in client.chat.completions.messages.list(made.id)] == ["Be brief.", "Tell me a story."]
    assert client.chat.completions.update(made.id, metadata={"suite": "renamed"}).metadata == {"suite": "renamed"}
    assert client.chat.completions.delete(made.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(made.id)


def test_bad_metadata_and_store_where_nothing_is_stored_are_400s(
    server: PlatformServer, tiny_engine: AsyncLLM,  # noqa: F811
) -> None:
    with server.client() as client:
        for metadata, why in (({str(i): "x" for i in range(17)}, "pairs"), ({"k" * 65: "x"}, "key"),
                              ({"k": "v" * 513}, "value"), ({"k": 1}, "not a string")):
            refused = client.post("/v1/chat/completions", json=_body(store=True, metadata=metadata))
            assert refused.status_code == 400, why
            assert _error(refused)["param"].startswith("metadata"), why
        legacy = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "store": True})
        assert legacy.status_code == 400 and _error(legacy)["param"] == "store"
        assert client.get("/v1/chat/completions").json()["data"] == []
    with app_serving(build_app(tiny_engine, MODEL)) as base_url, httpx.Client(base_url=base_url) as bare:
        refused = bare.post("/v1/chat/completions", json=_body(store=True))
        assert refused.status_code == 400 and _error(refused)["param"] == "store"
        assert bare.post("/v1/chat/completions", json=_body(store=False)).status_code == 200
        listing = bare.get("/v1/chat/completions")
        assert listing.status_code == 404 and _error(listing)["code"] == "not_enabled"
