"""Stored Responses API responses: per-key ownership, the conversation a chain of responses adds up to, a chain
that lost a turn, input items a page at a time, deletion and purging by age, a background response replaced only
while it has not ended; on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from llmserve.errors import InvalidRequestError
from llmserve.platform.responses import ResponseChainBroken, ResponseNotFound, ResponseStore, with_ids
from llmserve.store.db import Database
from llmserve.store.schema import utcnow
from tests.store.fixtures import db_fixture, shared_db_fixture  # noqa: F401

KEY = "key_alice"
OTHER = "key_bob"


@pytest.fixture(name="store")
def store_fixture(db: Database) -> ResponseStore:
    return ResponseStore(db)


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _response(response_id: str, reply: str) -> dict:
    return {"id": response_id, "object": "response", "model": "tiny", "status": "completed",
            "output": [{"type": "message", "id": f"msg_{response_id}", "role": "assistant",
                        "content": [{"type": "output_text", "text": reply}]}]}


def _turn(store: ResponseStore, key: str | None, response_id: str, question: str, previous: str | None) -> list[dict]:
    items = with_ids([_user(question)])
    store.save(key, _response(response_id, f"re: {question}"), items, previous)
    return items


def _texts(items: list[dict]) -> list[str]:
    return [item["content"] if isinstance(item["content"], str) else item["content"][0]["text"] for item in items]


def test_a_chain_gives_every_turn_in_order_and_only_to_its_key(store: ResponseStore) -> None:
    _turn(store, KEY, "resp_1", "one", None)
    _turn(store, KEY, "resp_2", "two", "resp_1")
    _turn(store, KEY, "resp_3", "three", "resp_2")
    _turn(store, KEY, "resp_2b", "two again", "resp_1")  # a fork: both branches keep their own turns
    assert _texts(store.context(KEY, "resp_3")) == ["one", "re: one", "two", "re: two", "three", "re: three"]
    assert _texts(store.context(KEY, "resp_2b")) == ["one", "re: one", "two again", "re: two again"]
    assert store.get(KEY, "resp_2")["output"][0]["content"][0]["text"] == "re: two"
    for call in (lambda: store.get(OTHER, "resp_2"), lambda: store.context(OTHER, "resp_3"),
                 lambda: store.get(None, "resp_1"), lambda: store.get(KEY, "resp_none")):
        with pytest.raises(ResponseNotFound):
            call()


def test_local_mode_owns_the_responses_stored_without_a_key(store: ResponseStore) -> None:
    _turn(store, None, "resp_local", "hello", None)
    _turn(store, None, "resp_local_2", "again", "resp_local")
    assert _texts(store.context(None, "resp_local_2")) == ["hello", "re: hello", "again", "re: again"]
    with pytest.raises(ResponseNotFound):
        store.get(KEY, "resp_local")


def test_a_chain_that_lost_a_turn_cannot_be_continued(store: ResponseStore) -> None:
    _turn(store, KEY, "resp_1", "one", None)
    _turn(store, KEY, "resp_2", "two", "resp_1")
    _turn(store, KEY, "resp_3", "three", "resp_2")
    store.delete(KEY, "resp_2")
    with pytest.raises(ResponseNotFound):
        store.delete(KEY, "resp_2")
    with pytest.raises(ResponseChainBroken) as broken:
        store.context(KEY, "resp_3")
    assert broken.value.missing_id == "resp_2"
    assert store.get(KEY, "resp_3")["id"] == "resp_3"  # still readable
    # another key's response named as the previous one is not this chain's either
    _turn(store, OTHER, "resp_other", "theirs", None)
    _turn(store, KEY, "resp_mixed", "mine", "resp_other")
    with pytest.raises(ResponseChainBroken):
        store.context(KEY, "resp_mixed")


def test_a_chain_longer_than_the_bound_is_refused(db: Database) -> None:
    store = ResponseStore(db, max_turns=3)
    previous = None
    for i in range(4):
        _turn(store, KEY, f"resp_{i}", str(i), previous)
        previous = f"resp_{i}"
    assert len(store.context(KEY, "resp_2")) == 6
    with pytest.raises(InvalidRequestError, match="more than 3 turns"):
        store.context(KEY, "resp_3")


def test_input_items_come_a_page_at_a_time_either_way(store: ResponseStore) -> None:
    items = with_ids([_user(str(i)) for i in range(5)])
    store.save(KEY, _response("resp_p", "ok"), items, None)
    ids = [item["id"] for item in items]
    assert all(item_id.startswith("msg_") for item_id in ids) and len(set(ids)) == 5
    page, more = store.input_items(KEY, "resp_p", limit=2)
    assert [i["id"] for i in page] == [ids[4], ids[3]] and more
    page, more = store.input_items(KEY, "resp_p", limit=2, after=ids[3])
    assert [i["id"] for i in page] == [ids[2], ids[1]] and more
    page, more = store.input_items(KEY, "resp_p", limit=10, after=ids[2], order="asc")
    assert [i["id"] for i in page] == ids[3:] and not more
    with pytest.raises(InvalidRequestError, match="No input item"):
        store.input_items(KEY, "resp_p", after="msg_unknown")
    with pytest.raises(InvalidRequestError, match="limit"):
        store.input_items(KEY, "resp_p", limit=0)
    with pytest.raises(ResponseNotFound):
        store.input_items(OTHER, "resp_p")


def test_items_keep_their_own_ids_and_get_their_type(store: ResponseStore) -> None:
    items = with_ids([{"id": "msg_mine", "role": "user", "content": "x"},
                      {"type": "function_call_output", "call_id": "call_1", "output": "18"}])
    assert items[0] == {"id": "msg_mine", "type": "message", "role": "user", "content": "x"}
    assert items[1]["id"].startswith("fco_") and items[1]["type"] == "function_call_output"


def test_purge_removes_responses_older_than_the_retention(store: ResponseStore) -> None:
    _turn(store, KEY, "resp_old", "old", None)
    assert store.purge(timedelta(days=30)) == 0
    assert store.purge(timedelta(days=30), now=utcnow() + timedelta(days=31)) == 1
    with pytest.raises(ResponseNotFound):
        store.get(KEY, "resp_old")


def test_a_background_response_is_replaced_only_while_it_has_not_ended(store: ResponseStore) -> None:
    queued = {**_response("resp_bg", ""), "status": "queued", "output": []}
    store.save(KEY, queued, with_ids([_user("long story")]), None)
    assert store.replace_unfinished(KEY, {**queued, "status": "in_progress"})
    assert not store.replace_unfinished(OTHER, {**queued, "status": "cancelled"})  # another key's: untouched
    assert store.replace_unfinished(KEY, {**queued, "status": "cancelled"})
    assert not store.replace_unfinished(KEY, {**_response("resp_bg", "the end"), "model": "other"})
    assert store.get(KEY, "resp_bg") == {**queued, "status": "cancelled"}
    assert not store.replace_unfinished(KEY, {**queued, "id": "resp_unknown"})
    _turn(store, KEY, "resp_fg", "hello", None)  # a response stored finished is never replaced
    assert not store.replace_unfinished(KEY, {**_response("resp_fg", "other"), "status": "in_progress"})


def _at_once(store: ResponseStore, ends: list[dict]) -> dict[str, bool]:
    """Each of `ends` replacing the stored response from a thread of its own, all at once: by status, whether it
    did."""
    start = threading.Barrier(len(ends))
    replaced: dict[str, bool] = {}

    def end(response: dict) -> None:
        start.wait()
        replaced[response["status"]] = store.replace_unfinished(KEY, response)

    threads = [threading.Thread(target=end, args=(response,)) for response in ends]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return replaced


def test_of_two_racing_ends_of_a_background_response_one_stands(store: ResponseStore) -> None:
    """A cancel and the run's end, from two processes at once: exactly one replaces the response, and it stays."""
    for round_ in range(5):
        response_id = f"resp_race_{round_}"
        running = {**_response(response_id, ""), "status": "in_progress", "output": []}
        store.save(KEY, running, [], None)
        replaced = _at_once(store, [{**running, "status": "cancelled"}, _response(response_id, "the end")])
        [winner] = [status for status, won in replaced.items() if won]
        assert len(replaced) == 2 and store.get(KEY, response_id)["status"] == winner
