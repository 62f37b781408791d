"""The Batch API's store, on SQLite and PostgreSQL: servers sharing a database run each batch once (one lease at a
time, even when they claim at the same moment), a lapsed lease hands the batch on, a request answered twice keeps
its first answer, the output and error files come out in input order with the counts, and files are paged by
key."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
from sqlalchemy import update

from llmserve.errors import InvalidRequestError
from llmserve.platform.batches import BatchStore, FileNotFound, FileStore, result_record, unanswered_record
from llmserve.store.db import Database
from llmserve.store.schema import FileRow, utcnow
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


def _expire(db: Database, *file_ids: str) -> None:
    """The files' expiry passes (as it would an hour or 30 days on)."""
    with db.session(write=True) as session:
        session.execute(update(FileRow).where(FileRow.id.in_(file_ids)).values(expires_at=utcnow() - timedelta(1)))


def test_an_expired_file_is_gone_but_for_the_unfinished_batch_that_reads_it(store: BatchStore, db: Database):
    batch_id = _batch(store)
    input_id = store.get(KEY, batch_id)["input_file_id"]
    other = store.files.create(KEY, "other.jsonl", "batch", b"{}\n", expires_after=3600)
    assert other["expires_at"] - other["created_at"] == 3600
    assert store.files.get(KEY, input_id)["expires_at"] - store.files.get(KEY, input_id)["created_at"] == 30 * 86400
    _expire(db, input_id, other["id"])
    for file_id in (input_id, other["id"]):
        with pytest.raises(FileNotFound):
            store.files.get(KEY, file_id)
        with pytest.raises(FileNotFound):
            store.files.content(KEY, file_id)
    assert store.files.list(KEY) == ([], False)
    with pytest.raises(FileNotFound):
        store.create(KEY, input_id, "/v1/completions", "24h", None)
    claimed = store.claim("runner_a", LEASE)
    assert claimed is not None and store.input_of(claimed) is not None  # the batch made from it still runs
    assert store.files.purge_expired() == 1  # the other file; the input waits for its batch
    store.start(batch_id, "runner_a", 3)
    store.finish(batch_id, "runner_a", "completed", [])
    assert store.files.purge_expired() == 1 and store.files.purge_expired() == 0


def test_a_batchs_output_is_kept_as_long_as_it_asked(store: BatchStore):
    uploaded = store.files.create(KEY, "in.jsonl", "batch", b"{}\n")
    batch_id = store.create(KEY, uploaded["id"], "/v1/completions", "24h", None, output_expires_after=7200)["id"]
    store.claim("runner_a", LEASE)
    store.start(batch_id, "runner_a", 1)
    store.save_result(batch_id, 0, True, result_record("r0", 200, "a", {}))
    store.finish(batch_id, "runner_a", "completed", [])
    output = store.files.get(KEY, store.get(KEY, batch_id)["output_file_id"])
    assert output["expires_at"] - output["created_at"] == 7200
    for seconds in (3599, 30 * 86400 + 1):
        with pytest.raises(InvalidRequestError, match="between 3600 and 2592000") as refused:
            store.files.create(KEY, "in.jsonl", "batch", b"{}\n", expires_after=seconds)
        assert refused.value.param == "expires_after.seconds"
        with pytest.raises(InvalidRequestError) as refused:
            store.create(KEY, uploaded["id"], "/v1/completions", "24h", None, output_expires_after=seconds)
        assert refused.value.param == "output_expires_after.seconds"
