"""The usage journal: what one run journaled reaches the database at the next start, exactly once;
requests that never ended are recorded as interrupted; segments go once their records are stored."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import pytest
from sqlalchemy import select

from llmserve.platform.usage import UsageRecord, UsageRecorder, UsageStatus
from llmserve.platform.usage_journal import UsageJournal
from llmserve.store.db import Database
from llmserve.store.schema import UsageRecordRow
from tests.store.fixtures import db_fixture, shared_db_fixture  # noqa: F401

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=timezone.utc)


def usage(request_id: str, **fields: object) -> UsageRecord:
    values: dict = {"key_id": "key-1", "model": "m", "prompt_tokens": 10, "completion_tokens": 5, "created_at": T0}
    values.update(fields)
    return UsageRecord(request_id=request_id, **values)


def stored(db: Database) -> dict[str, UsageRecordRow]:
    with db.session() as session:
        return {row.request_id: row for row in session.scalars(select(UsageRecordRow))}


def journal_files(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


def test_a_previous_runs_records_reach_the_database_and_unended_requests_are_interrupted(
    db: Database, tmp_path: Path
) -> None:
    first = UsageJournal(tmp_path)
    first.start("done", "key-1", "m", 10, T0)
    first.start("cut", "key-1", "m", 7, T0)
    first.tokens("cut", 32, 3)
    first.tokens("cut", 48, 3)
    first.end(usage("done", completion_tokens=20)).result(timeout=10)  # on disk
    first.close()  # never reached the database, and "cut" never ended: the files stay
    assert any(name.endswith(".jsonl") for name in journal_files(tmp_path))

    recorder = UsageRecorder(db, flush_interval=3600, journal=UsageJournal(tmp_path))
    assert recorder.flush() == 2
    rows = stored(db)
    assert (rows["done"].status, rows["done"].completion_tokens) == (UsageStatus.COMPLETED, 20)
    cut = rows["cut"]
    assert (cut.status, cut.prompt_tokens, cut.completion_tokens, cut.cached_tokens, cut.key_id) == (
        UsageStatus.INTERRUPTED, 7, 48, 3, "key-1")
    assert cut.created_at == T0
    recorder.close()
    assert journal_files(tmp_path) == []  # everything is in the database


def test_a_prompt_count_learned_while_running_is_the_interrupted_records(db: Database, tmp_path: Path) -> None:
    """A gateway starts a request before it knows the prompt's tokens (the replica reports them)."""
    first = UsageJournal(tmp_path)
    first.start("relayed", "key-1", "m", 0, T0)
    first.tokens("relayed", 16, 0, 11)
    first.tokens("relayed", 32, 0, 11)  # the same count again: not journaled again
    first.close()
    assert sum(line.count('"prompt": 11') + line.count('"prompt":11')
               for path in tmp_path.glob("*.jsonl") for line in path.read_text().splitlines()) == 1

    recorder = UsageRecorder(db, flush_interval=3600, journal=UsageJournal(tmp_path))
    assert recorder.flush() == 1
    row = stored(db)["relayed"]
    assert (row.status, row.prompt_tokens, row.completion_tokens) == (UsageStatus.INTERRUPTED, 11, 32)
    recorder.close()


def test_replaying_records_already_in_the_database_stores_each_once(db: Database, tmp_path: Path) -> None:
    without_journal = UsageRecorder(db, flush_interval=3600)
    without_journal.record(usage("a", completion_tokens=1))
    without_journal.close()
    first = UsageJournal(tmp_path)  # the server died after writing "a" to the database, before
    first.end(usage("a", completion_tokens=1))  # its journal learned that it was stored
    first.end(usage("b"))
    first.close()

    again = UsageRecorder(db, flush_interval=3600, journal=UsageJournal(tmp_path))
    assert again.pending == 2
    again.flush()
    again.close()
    rows = stored(db)
    assert sorted(rows) == ["a", "b"] and rows["a"].completion_tokens == 1
    assert journal_files(tmp_path) == []


def test_a_running_servers_journal_is_left_alone(db: Database, tmp_path: Path) -> None:
    running = UsageJournal(tmp_path)
    running.start("live", None, "m", 5, T0)
    other = UsageRecorder(db, flush_interval=3600, journal=UsageJournal(tmp_path))
    assert other.pending == 0
    other.close()
    running.end(usage("live", key_id=None))
    running.close()
    recovered = UsageJournal(tmp_path)
    assert [r.request_id for r in recovered.recover()] == ["live"]
    recovered.close()


def test_full_segments_rotate_and_go_once_stored_keeping_requests_still_running(
    db: Database, tmp_path: Path
) -> None:
    recorder = UsageRecorder(db, flush_interval=3600, journal=UsageJournal(tmp_path, segment_bytes=600))
    recorder.started("long", None, "m", 9, T0)
    recorder.journal_end(usage("never-buffered"))
    for i in range(40):
        recorder.progress("long", i + 1, 0)
        record = usage(f"short-{i:02d}")
        recorder.journal_end(record).result(timeout=10)
        recorder.record(record)
    recorder.flush()
    recorder.close()  # "long" still runs, "never-buffered" never reached the database: both stay

    # The first segment (for "never-buffered") and the newest (with "long" copied in) are all that is left.
    first, newest = sorted((p for p in tmp_path.iterdir() if p.suffix == ".jsonl"), key=lambda p: len(p.name))
    assert first.name.endswith("-0.jsonl") and not newest.name.endswith("-0.jsonl")
    again = UsageJournal(tmp_path)
    recovered = {r.request_id: r for r in again.recover()}
    # Besides those two, only the stored records sharing the first segment come back (stored once again).
    assert {"long", "never-buffered"} <= set(recovered) and len(recovered) < 10
    assert (recovered["long"].status, recovered["long"].completion_tokens) == (UsageStatus.INTERRUPTED, 40)
    again.close()


def test_a_torn_last_line_is_skipped(db: Database, tmp_path: Path) -> None:
    first = UsageJournal(tmp_path)
    first.end(usage("whole")).result(timeout=10)
    first.close()
    [segment] = [p for p in tmp_path.iterdir() if p.suffix == ".jsonl"]
    with segment.open("ab") as file:
        file.write(json.dumps({"e": "end", "record": {"request_id": "torn"}}).encode()[:20])
    recorder = UsageRecorder(db, flush_interval=3600, journal=UsageJournal(tmp_path))
    recorder.flush()
    recorder.close()
    assert sorted(stored(db)) == ["whole"]


def test_concurrent_ends_share_fsyncs(tmp_path: Path) -> None:
    journal = UsageJournal(tmp_path)
    with ThreadPoolExecutor(16) as pool:
        futures = list(pool.map(lambda i: journal.end(usage(f"r-{i}")), range(400)))
    for future in futures:
        future.result(timeout=10)
    assert 1 <= journal.fsyncs < 400
    journal.close()


def _blocked_fdatasync(monkeypatch, release: threading.Event, entered: threading.Event) -> None:
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        entered.set()
        assert release.wait(timeout=30)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)


def test_write_sync_releases_an_end_once_written_and_fsyncs_after(monkeypatch, tmp_path: Path) -> None:
    release, entered = threading.Event(), threading.Event()
    _blocked_fdatasync(monkeypatch, release, entered)
    journal = UsageJournal(tmp_path, sync="write")
    journal.start("r", "key-1", "m", 10, T0)
    journal.end(usage("r")).result(timeout=10)  # while the fsync is still held up
    assert entered.wait(timeout=10)
    segment = next(tmp_path.glob("*.jsonl"))
    assert json.loads(segment.read_bytes().splitlines()[-1])["record"]["request_id"] == "r"
    release.set()
    journal.close()
    assert journal.fsyncs >= 1


def test_fsync_mode_holds_an_end_until_it_is_on_disk(monkeypatch, tmp_path: Path) -> None:
    release, entered = threading.Event(), threading.Event()
    _blocked_fdatasync(monkeypatch, release, entered)
    journal = UsageJournal(tmp_path)
    journal.start("r", "key-1", "m", 10, T0)
    done = journal.end(usage("r"))
    assert entered.wait(timeout=10)
    assert not done.done()
    release.set()
    done.result(timeout=10)
    journal.close()


def test_an_unknown_sync_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sync mode"):
        UsageJournal(tmp_path, sync="never")
