"""Stored chat completions: per-key ownership, listing by creation time with the model and metadata filters a page at
a time, the request's messages in OpenAI's stored shape, metadata replaced, deletion and purging by age; on SQLite
and PostgreSQL."""

from __future__ import annotations

from datetime import timedelta

import pytest

from llmserve.errors import InvalidRequestError
from llmserve.platform.chat_completions import CompletionNotFound, StoredCompletions, stored_messages
from llmserve.store.db import Database
from llmserve.store.schema import utcnow
from tests.store.fixtures import db_fixture, shared_db_fixture  # noqa: F401

KEY = "key_alice"
OTHER = "key_bob"


@pytest.fixture(name="store")
def store_fixture(db: Database) -> StoredCompletions:
    return StoredCompletions(db)


def _completion(completion_id: str, model: str = "tiny", reply: str = "hi") -> dict:
    return {"id": completion_id, "object": "chat.completion", "created": 1, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


def _save(store: StoredCompletions, key: str | None, completion_id: str, model: str = "tiny", **metadata: str) -> None:
    messages = stored_messages(completion_id, [{"role": "user", "content": f"question {completion_id}"}])
    store.save(key, _completion(completion_id, model), messages, metadata)


def _ids(page: tuple[list[dict], bool]) -> tuple[list[str], bool]:
    found, has_more = page
    return [completion["id"] for completion in found], has_more


def test_a_completion_is_read_back_as_answered_with_its_metadata_by_its_key_alone(store: StoredCompletions) -> None:
    _save(store, KEY, "chatcmpl-a", topic="math")
    assert store.get(KEY, "chatcmpl-a") == {**_completion("chatcmpl-a"), "metadata": {"topic": "math"}}
    for key in (OTHER, None):  # another key, and local mode, see nothing
        with pytest.raises(CompletionNotFound):
            store.get(key, "chatcmpl-a")
        assert store.list(key) == ([], False)
        with pytest.raises(CompletionNotFound):
            store.delete(key, "chatcmpl-a")
        with pytest.raises(CompletionNotFound):
            store.update_metadata(key, "chatcmpl-a", {})
    assert _ids(store.list(KEY)) == (["chatcmpl-a"], False)


def test_listing_pages_in_either_order_filtered_by_model_and_every_metadata_pair(store: StoredCompletions) -> None:
    for i in range(5):
        _save(store, KEY, f"chatcmpl-{i}", model="big" if i == 3 else "tiny", topic="math" if i % 2 else "art",
              team="a" if i < 3 else "b")
    assert _ids(store.list(KEY, limit=2)) == (["chatcmpl-0", "chatcmpl-1"], True)
    assert _ids(store.list(KEY, limit=2, after="chatcmpl-1")) == (["chatcmpl-2", "chatcmpl-3"], True)
    assert _ids(store.list(KEY, limit=2, after="chatcmpl-3")) == (["chatcmpl-4"], False)
    assert _ids(store.list(KEY, limit=3, order="desc")) == (["chatcmpl-4", "chatcmpl-3", "chatcmpl-2"], True)
    assert _ids(store.list(KEY, order="desc", after="chatcmpl-2")) == (["chatcmpl-1", "chatcmpl-0"], False)
    assert _ids(store.list(KEY, model="big")) == (["chatcmpl-3"], False)
    assert _ids(store.list(KEY, metadata={"topic": "math"})) == (["chatcmpl-1", "chatcmpl-3"], False)
    assert _ids(store.list(KEY, metadata={"topic": "math", "team": "a"})) == (["chatcmpl-1"], False)
    assert _ids(store.list(KEY, model="tiny", metadata={"team": "b"})) == (["chatcmpl-4"], False)
    assert _ids(store.list(KEY, metadata={"nobody": "x"})) == ([], False)
    with pytest.raises(InvalidRequestError) as unknown:
        store.list(KEY, after="chatcmpl-missing")
    assert unknown.value.param == "after"
    with pytest.raises(InvalidRequestError):
        store.list(OTHER, after="chatcmpl-0")  # another key's id is no cursor either
    for limit in (0, 101):
        with pytest.raises(InvalidRequestError):
            store.list(KEY, limit=limit)


def test_messages_are_listed_in_openais_stored_shape_a_page_at_a_time(store: StoredCompletions) -> None:
    sent = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "this?"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                              "function": {"name": "look", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a cat"},
    ]
    store.save(KEY, _completion("chatcmpl-m"), stored_messages("chatcmpl-m", sent), {})
    messages, has_more = store.messages(KEY, "chatcmpl-m")
    assert not has_more
    assert [m["id"] for m in messages] == [f"chatcmpl-m-{i}" for i in range(4)]
    assert messages[0] == {"id": "chatcmpl-m-0", "role": "system", "content": "Be brief.", "content_parts": None}
    assert messages[1]["content"] == "What is this?" and messages[1]["content_parts"] == sent[1]["content"]
    assert messages[2]["content"] is None and messages[2]["tool_calls"] == sent[2]["tool_calls"]
    assert messages[3]["tool_call_id"] == "call_1"
    assert _ids(store.messages(KEY, "chatcmpl-m", limit=3, order="desc")) == (
        ["chatcmpl-m-3", "chatcmpl-m-2", "chatcmpl-m-1"], True)
    assert _ids(store.messages(KEY, "chatcmpl-m", limit=3, after="chatcmpl-m-1")) == (
        ["chatcmpl-m-2", "chatcmpl-m-3"], False)
    with pytest.raises(InvalidRequestError):
        store.messages(KEY, "chatcmpl-m", after="chatcmpl-m-9")
    with pytest.raises(CompletionNotFound):
        store.messages(OTHER, "chatcmpl-m")


def test_metadata_is_replaced_and_listed_by_its_new_values(store: StoredCompletions) -> None:
    _save(store, KEY, "chatcmpl-u", topic="math", team="a")
    updated = store.update_metadata(KEY, "chatcmpl-u", {"topic": "art"})
    assert updated["metadata"] == {"topic": "art"} and store.get(KEY, "chatcmpl-u") == updated
    assert _ids(store.list(KEY, metadata={"topic": "art"})) == (["chatcmpl-u"], False)
    assert _ids(store.list(KEY, metadata={"team": "a"})) == ([], False)
    assert store.update_metadata(KEY, "chatcmpl-u", {})["metadata"] == {}


def test_deleted_and_purged_completions_are_gone(store: StoredCompletions) -> None:
    _save(store, KEY, "chatcmpl-d")
    _save(store, None, "chatcmpl-local")
    store.delete(KEY, "chatcmpl-d")
    with pytest.raises(CompletionNotFound):
        store.get(KEY, "chatcmpl-d")
    assert _ids(store.list(None)) == (["chatcmpl-local"], False)
    assert store.purge(timedelta(days=30)) == 0
    assert store.purge(timedelta(days=30), now=utcnow() + timedelta(days=31)) == 1
    with pytest.raises(CompletionNotFound):
        store.get(None, "chatcmpl-local")
