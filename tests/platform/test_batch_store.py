"""The Batch API's store, on SQLite and PostgreSQL: servers sharing a database run each batch once (one lease at a
time, even when they claim at the same moment), a lapsed lease hands the batch on, a request answered twice keeps
its first answer, the output and error files come out in input order with the counts, and files are paged by
key."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest

from llmserve.errors import InvalidRequestError
from llmserve.platform.batches import BatchStore, FileStore, result_record, unanswered_record
from llmserve.store.db import Database
from tests.store.fixtures import db_fixture, shared_db_fixture  # noqa: F401

KEY = "key_alice"
LEASE = timedelta(seconds=30)


@pytest.fixture(name="store")
def store_fixture(db: Database) -> BatchStore:
    return BatchStore(db, FileStore(db, max_bytes=1 << 20))


def _batch(store: BatchStore, lines: int = 3, key: str | None = KEY) -> str:
    content = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                  "body": {"model": "m", "prompt": "x"}}) + "\n" for i in range(lines))
    uploaded = store.files.create(key, "in.jsonl", "batch", content.encode())
    return store.create(key, uploaded["id"], "/v1/completions", "24h", None)["id"]


def test_servers_claiming_at_once_take_each_batch_once(store: BatchStore):
    made = {_batch(store) for _ in range(4)}
    claimed: list[str] = []
    start = threading.Barrier(8)

    def claim(runner: str) -> None:
        start.wait()
        while (batch := store.claim(runner, LEASE)) is not None:
            claimed.append(batch.id)

    threads = [threading.Thread(target=claim, args=(f"runner_{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(claimed) == sorted(made)


def test_a_lapsed_lease_hands_the_batch_on_and_its_answers_stay(store: BatchStore):
    batch_id = _batch(store)
    assert store.claim("runner_a", timedelta(0)).id == batch_id
    store.start(batch_id, "runner_a", 3)
    store.save_result(batch_id, 0, True, result_record("r0", 200, "a", {"first": True}))
    taken = store.claim("runner_b", LEASE)
    assert taken is not None and (taken.id, taken.status) == (batch_id, "in_progress")
    assert store.claim("runner_c", LEASE) is None  # runner_b holds it now
    assert store.renew(batch_id, "runner_a", LEASE) is None  # runner_a learns it lost it
    store.finish(batch_id, "runner_a", "completed", [])  # and cannot end it
    assert store.get(KEY, batch_id)["status"] == "in_progress"

    store.save_result(batch_id, 0, True, result_record("r0", 200, "b", {"first": False}))  # answered twice
    store.save_result(batch_id, 2, False, result_record("r2", 400, "b", {"error": {"message": "no"}}))
    store.save_result(batch_id, 1, True, result_record("r1", 200, "b", {"second": True}))
    store.finish(batch_id, "runner_b", "completed", [])
    batch = store.get(KEY, batch_id)
    assert batch["status"] == "completed" and batch["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    output = [json.loads(line) for line in store.files.content(KEY, batch["output_file_id"]).splitlines()]
    assert [(r["custom_id"], r["response"]["body"]) for r in output] == [("r0", {"first": True}),
                                                                          ("r1", {"second": True})]
    [error] = [json.loads(line) for line in store.files.content(KEY, batch["error_file_id"]).splitlines()]
    assert error["custom_id"] == "r2"
    assert store.claim("runner_c", timedelta(0)) is None  # ended: nobody takes it


def test_a_cancel_during_the_last_requests_ends_it_cancelled_with_what_never_ran(store: BatchStore):
    batch_id = _batch(store)
    store.claim("runner_a", LEASE)
    store.start(batch_id, "runner_a", 3)
    store.save_result(batch_id, 0, True, result_record("r0", 200, "a", {}))
    assert store.cancel(KEY, batch_id)["status"] == "cancelling"
    assert store.renew(batch_id, "runner_a", LEASE) == "cancelling"
    never = [unanswered_record(f"r{i}", "batch_cancelled", "cancelled") for i in (1, 2)]
    store.finish(batch_id, "runner_a", "completed", never)
    batch = store.get(KEY, batch_id)
    assert batch["status"] == "cancelled" and batch["cancelled_at"] is not None
    assert batch["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
    with pytest.raises(Exception, match="no longer be cancelled"):
        store.cancel(KEY, batch_id)


def test_files_are_paged_by_key_newest_first(store: BatchStore):
    ids = [store.files.create(KEY, f"{i}.jsonl", "batch", b"{}\n")["id"] for i in range(5)]
    store.files.create("key_bob", "theirs.jsonl", "batch", b"{}\n")
    first, more = store.files.list(KEY, limit=2)
    assert [f["id"] for f in first] == ids[:-3:-1] and more
    rest, more = store.files.list(KEY, limit=10, after=first[-1]["id"])
    assert [f["id"] for f in rest] == ids[2::-1] and not more
    ascending, _ = store.files.list(KEY, order="asc")
    assert [f["id"] for f in ascending] == ids
    with pytest.raises(InvalidRequestError):
        store.files.list(KEY, after="file-unknown")
    assert store.files.list(None)[0] == []  # local mode owns only what was made without a key
