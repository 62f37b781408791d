"""Usage metering: batched idempotent writes off the request path, retries, shutdown, and the usage report."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import create_engine, func, select, text

from llmserve.platform.usage import Price, PriceTable, UsageRecord, UsageRecorder, UsageStatus, query_usage
from llmserve.store.db import Database
from llmserve.store.schema import ApiKeyRow, UsageRecordRow
from tests.store.fixtures import add_postgres_options, db_fixture, recorded_statements, shared_db_fixture  # noqa: F401

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=timezone.utc)


def usage(request_id: str, **fields: object) -> UsageRecord:
    values: dict = {"key_id": None, "model": "m", "prompt_tokens": 10, "completion_tokens": 5, "created_at": T0}
    values.update(fields)
    return UsageRecord(request_id=request_id, **values)


def stored_rows(db: Database) -> list[UsageRecordRow]:
    with db.session() as session:
        return list(session.scalars(select(UsageRecordRow).order_by(UsageRecordRow.request_id)))


def row_count(db: Database) -> int:
    with db.session() as session:
        return session.scalar(select(func.count()).select_from(UsageRecordRow))


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.fixture(name="recorder")
def recorder_fixture(db: Database) -> Iterator[UsageRecorder]:
    """A recorder whose background thread never fires on its own during a test."""
    recorder = UsageRecorder(db, flush_interval=3600)
    yield recorder
    recorder.close()


def test_record_does_no_database_work_until_a_flush(db: Database, recorder: UsageRecorder) -> None:
    with recorded_statements(db.engine) as statements:
        for i in range(50):
            recorder.record(usage(f"req-{i:02d}"))
    assert statements == []
    assert (recorder.pending, recorder.flushes, row_count(db)) == (50, 0, 0)

    assert recorder.flush() == 50
    assert (recorder.pending, recorder.flushes, recorder.written, row_count(db)) == (0, 1, 50, 50)


def test_the_same_request_id_is_stored_once(db: Database, recorder: UsageRecorder) -> None:
    recorder.record(usage("dup", completion_tokens=5))
    recorder.record(usage("dup", completion_tokens=99))  # same flush
    recorder.flush()
    recorder.record(usage("dup", completion_tokens=77))  # a later flush
    recorder.flush()
    assert [(r.request_id, r.completion_tokens) for r in stored_rows(db)] == [("dup", 5)]


def test_all_fields_round_trip(db: Database, recorder: UsageRecorder) -> None:
    arrived = datetime(2025, 3, 1, 23, 30, 15, 123456, tzinfo=timezone(timedelta(hours=-2)))
    recorder.record(UsageRecord(
        "req-1", "key_abc", "tiny-llama", 100, 7, cached_tokens=64, status=UsageStatus.DISCONNECTED,
        created_at=arrived, ttft_ms=12.5, latency_ms=250.25,
    ))
    recorder.flush()
    [row] = stored_rows(db)
    assert (row.key_id, row.model, row.prompt_tokens, row.completion_tokens, row.cached_tokens, row.status) == (
        "key_abc", "tiny-llama", 100, 7, 64, "disconnected",
    )
    assert row.created_at == arrived and row.created_at.tzinfo == timezone.utc
    assert (row.ttft_ms, row.latency_ms) == (12.5, 250.25)


def test_flushes_write_at_most_max_batch_records_at_a_time(db: Database) -> None:
    recorder = UsageRecorder(db, flush_interval=3600, max_batch=10)
    try:
        for i in range(25):
            recorder.record(usage(f"req-{i}"))
        with recorded_statements(db.engine) as statements:
            assert recorder.flush() == 25
        inserts = [s for s in statements if s.lstrip().upper().startswith("INSERT")]
        assert (recorder.flushes, len(inserts), row_count(db)) == (3, 3, 25)
    finally:
        recorder.close()


def test_the_background_thread_flushes_every_interval(db: Database) -> None:
    recorder = UsageRecorder(db, flush_interval=0.05)
    try:
        for i in range(5):
            recorder.record(usage(f"req-{i}"))
        wait_until(lambda: row_count(db) == 5)
        assert recorder.pending == 0
    finally:
        recorder.close()


def test_a_full_batch_wakes_the_writer_before_the_interval(db: Database) -> None:
    recorder = UsageRecorder(db, flush_interval=3600, max_batch=10)
    try:
        for i in range(10):
            recorder.record(usage(f"req-{i}"))
        wait_until(lambda: row_count(db) == 10)
    finally:
        recorder.close()


def test_close_writes_everything_recorded_from_many_threads(db: Database) -> None:
    recorder = UsageRecorder(db, flush_interval=0.01, max_batch=100)
    threads = [
        threading.Thread(target=lambda t=t: [recorder.record(usage(f"t{t}-{i}")) for i in range(250)])
        for t in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    recorder.close()
    assert (row_count(db), recorder.written, recorder.pending, recorder.failed) == (2000, 2000, 0, 0)

    recorder.close()  # idempotent
    recorder.record(usage("late"))
    assert (recorder.dropped, row_count(db)) == (1, 2000)


@contextmanager
def write_lock_held(db: Database) -> Iterator[str]:
    """Another connection holds the write lock on the usage table; yields a URL for the same
    database whose connections give up waiting for that lock after 100 ms."""
    url = db.url.render_as_string(hide_password=False)
    if db.dialect == "sqlite":
        blocker = sqlite3.connect(db.url.database, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            yield f"{url}?timeout=0.1"
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        return
    engine = create_engine(url)
    try:
        with engine.connect() as connection, connection.begin():
            connection.execute(text("LOCK TABLE usage_records IN ACCESS EXCLUSIVE MODE"))
            yield add_postgres_options(url, "lock_timeout=100")
    finally:
        engine.dispose()


def test_records_stay_buffered_while_the_database_fails_and_are_written_later(db: Database) -> None:
    with write_lock_held(db) as short_wait_url:
        impatient = Database(short_wait_url)
        recorder = UsageRecorder(impatient, flush_interval=3600)
        for i in range(30):
            recorder.record(usage(f"req-{i}"))
        assert recorder.flush() == 0
        assert recorder.flush() == 0  # retried, failed again
        assert (recorder.pending, recorder.written, recorder.failed) == (30, 0, 0)
    assert recorder.flush() == 30
    assert (recorder.pending, recorder.written, row_count(db)) == (0, 30, 30)
    assert [r.request_id for r in stored_rows(db)] == sorted(f"req-{i}" for i in range(30))
    recorder.close()
    impatient.dispose()


def test_a_record_the_database_refuses_is_dropped_and_the_rest_written(db: Database, recorder: UsageRecorder) -> None:
    if db.dialect != "postgresql":
        pytest.skip("SQLite stores NUL characters; only PostgreSQL refuses this record")
    recorder.record(usage("good-1"))
    recorder.record(usage("bad", model="nul\x00model"))
    recorder.record(usage("good-2"))
    assert recorder.flush() == 2
    assert (recorder.written, recorder.failed, recorder.pending) == (2, 1, 0)
    assert [r.request_id for r in stored_rows(db)] == ["good-1", "good-2"]


def test_the_buffer_limit_drops_the_oldest_records(db: Database) -> None:
    recorder = UsageRecorder(db, flush_interval=3600, max_batch=2, max_buffered=3)
    try:
        for i in range(5):
            recorder.record(usage(f"req-{i}"))
        assert (recorder.pending, recorder.dropped) == (3, 2)
        recorder.flush()
        assert [r.request_id for r in stored_rows(db)] == ["req-2", "req-3", "req-4"]
    finally:
        recorder.close()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"request_id": ""}, "request_id must be a non-empty string"),
        ({"request_id": "x" * 256}, "request_id must be a non-empty string of at most 255"),
        ({"prompt_tokens": -1}, "prompt_tokens must be a non-negative integer"),
        ({"completion_tokens": 1.5}, "completion_tokens must be a non-negative integer"),
        ({"status": ""}, "status must be a non-empty string"),
        ({"model": None}, "model must be a non-empty string"),
    ],
)
def test_invalid_records_are_refused_at_record_time(recorder: UsageRecorder, fields: dict, message: str) -> None:
    fields = dict(fields)
    request_id = fields.pop("request_id", "req")
    with pytest.raises(ValueError, match=message):
        recorder.record(usage(request_id, **fields))
    assert recorder.pending == 0


# --- prices ---------------------------------------------------------------------------------------


def test_cost_bills_cached_tokens_at_the_cached_rate() -> None:
    price = Price(input_per_million=2.0, cached_input_per_million=0.5, output_per_million=8.0)
    # 600k uncached input, 400k cached, 250k output
    assert price.cost_usd(1_000_000, 400_000, 250_000) == pytest.approx(1.2 + 0.2 + 2.0)


def test_price_table_from_config() -> None:
    table = PriceTable.from_dict({"big": {"input_per_million": 3, "output_per_million": 15}})
    assert table.price("big") == Price(3.0, None, 15.0)
    assert table.cost_usd("big", 2_000_000, 1_000_000, 0) == pytest.approx(6.0)  # cached defaults to input
    assert table.cost_usd("unpriced", 10**9, 0, 10**9) == 0.0


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"m": {"input": 1.0}}, "unknown fields \\['input'\\]"),
        ({"m": {"output_per_million": -1}}, "output_per_million must be a non-negative number"),
        ({"m": {"input_per_million": "1"}}, "input_per_million must be a non-negative number"),
    ],
)
def test_price_table_refuses_bad_config(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PriceTable.from_dict(raw)


# --- the usage report -----------------------------------------------------------------------------

PRICES = PriceTable({
    "big": Price(input_per_million=10.0, cached_input_per_million=1.0, output_per_million=20.0),
    "small": Price(input_per_million=1.0, output_per_million=2.0),
})
DAY1 = datetime(2025, 3, 1, tzinfo=timezone.utc)
DAY2 = datetime(2025, 3, 2, tzinfo=timezone.utc)


@pytest.fixture(name="seeded")
def seeded_fixture(db: Database) -> Database:
    """Two keys, two models, two UTC days (one record given in a -02:00 zone)."""
    with db.session(write=True) as session:
        for key_id, name in (("key_a", "alice"), ("key_b", "bob")):
            session.add(ApiKeyRow(
                id=key_id, name=name, prefix="sk-llms-xxxx", secret_hash=key_id.ljust(64, "0"), tier="default",
                is_admin=False, created_at=DAY1,
            ))
    records = [
        UsageRecord("r1", "key_a", "big", 1000, 100, cached_tokens=400, created_at=DAY1 + timedelta(hours=1)),
        UsageRecord("r2", "key_a", "small", 2000, 200, created_at=DAY1 + timedelta(hours=23, minutes=59)),
        UsageRecord("r3", "key_b", "big", 3000, 300, cached_tokens=1000, created_at=DAY2 + timedelta(hours=5),
                    status=UsageStatus.DISCONNECTED),
        # 23:30 at -02:00 on March 1st is 01:30 UTC on March 2nd
        UsageRecord("r4", "key_b", "small", 4000, 400,
                    created_at=datetime(2025, 3, 1, 23, 30, tzinfo=timezone(timedelta(hours=-2)))),
        UsageRecord("r5", None, "small", 500, 50, created_at=DAY2 + timedelta(hours=23)),
    ]
    recorder = UsageRecorder(db, flush_interval=3600)
    for record in records:
        recorder.record(record)
    recorder.close()
    return db


def cost(model: str, prompt: int, cached: int, completion: int) -> float:
    return PRICES.cost_usd(model, prompt, cached, completion)


COST = {
    "r1": cost("big", 1000, 400, 100),  # 600*10 + 400*1 + 100*20 = 8400 / 1e6
    "r2": cost("small", 2000, 0, 200),
    "r3": cost("big", 3000, 1000, 300),
    "r4": cost("small", 4000, 0, 400),
    "r5": cost("small", 500, 0, 50),
}


def totals(requests: int, input_tokens: int, output_tokens: int, cached_tokens: int, *ids: str) -> dict:
    return {
        "requests": requests, "input_tokens": input_tokens, "output_tokens": output_tokens,
        "cached_tokens": cached_tokens, "cost_usd": pytest.approx(sum(COST[i] for i in ids)),
    }


def test_totals_over_everything(seeded: Database) -> None:
    report = query_usage(seeded, prices=PRICES)
    assert report == {
        "object": "usage", "start": None, "end": None, "group_by": None, "data": [],
        "total": totals(5, 10_500, 1050, 1400, "r1", "r2", "r3", "r4", "r5"),
    }
    assert COST["r1"] == pytest.approx(0.0084)


def test_grouped_by_model(seeded: Database) -> None:
    report = query_usage(seeded, group_by="model", prices=PRICES)
    assert report["data"] == [
        {"group": "big", **totals(2, 4000, 400, 1400, "r1", "r3")},
        {"group": "small", **totals(3, 6500, 650, 0, "r2", "r4", "r5")},
    ]
    assert report["total"] == totals(5, 10_500, 1050, 1400, "r1", "r2", "r3", "r4", "r5")


def test_grouped_by_key_with_names(seeded: Database) -> None:
    report = query_usage(seeded, group_by="key", prices=PRICES)
    assert report["data"] == [
        {"group": None, "key_name": None, **totals(1, 500, 50, 0, "r5")},
        {"group": "key_a", "key_name": "alice", **totals(2, 3000, 300, 400, "r1", "r2")},
        {"group": "key_b", "key_name": "bob", **totals(2, 7000, 700, 1000, "r3", "r4")},
    ]


def test_grouped_by_utc_day(seeded: Database) -> None:
    report = query_usage(seeded, group_by="day", prices=PRICES)
    assert report["data"] == [
        {"group": "2025-03-01", **totals(2, 3000, 300, 400, "r1", "r2")},
        {"group": "2025-03-02", **totals(3, 7500, 750, 1000, "r3", "r4", "r5")},
    ]


def test_a_key_sees_only_its_own_usage(seeded: Database) -> None:
    report = query_usage(seeded, key_id="key_b", group_by="model", prices=PRICES)
    assert report["data"] == [
        {"group": "big", **totals(1, 3000, 300, 1000, "r3")},
        {"group": "small", **totals(1, 4000, 400, 0, "r4")},
    ]
    assert query_usage(seeded, key_id="key_nobody")["total"]["requests"] == 0


def test_the_range_includes_start_and_excludes_end(seeded: Database) -> None:
    start = DAY1 + timedelta(hours=1)  # exactly r1's time
    end = DAY2 + timedelta(hours=5)  # exactly r3's time
    report = query_usage(seeded, start=start, end=end, prices=PRICES)
    assert report["total"] == totals(3, 7000, 700, 400, "r1", "r2", "r4")
    assert (report["start"], report["end"]) == ("2025-03-01T01:00:00+00:00", "2025-03-02T05:00:00+00:00")


def test_naive_bounds_are_utc(seeded: Database) -> None:
    report = query_usage(seeded, start=datetime(2025, 3, 2), prices=PRICES)
    assert report["total"]["requests"] == 3
    assert report["start"] == "2025-03-02T00:00:00+00:00"


def test_bad_report_arguments_raise_value_error(seeded: Database) -> None:
    with pytest.raises(ValueError, match="group_by must be one of model, key, day"):
        query_usage(seeded, group_by="hour")
    with pytest.raises(ValueError, match="start must not be after end"):
        query_usage(seeded, start=DAY2, end=DAY1)
