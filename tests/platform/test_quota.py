"""Token quotas: UTC calendar periods, and the ledger that counts a key's use exactly once across the
database, this process's unwritten records, and its running requests, on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import event

from llmserve.platform.keys import ApiKey
from llmserve.platform.quota import QuotaLedger, period_end, period_start
from llmserve.platform.usage import UsageRecord, UsageRecorder
from llmserve.store.db import Database, open_database
from tests.store.fixtures import db_fixture, shared_db_fixture  # noqa: F401

NOW = datetime(2026, 11, 28, 15, 30, tzinfo=timezone.utc)  # a Saturday
KEY = ApiKey(id="key_q", name="q", prefix="", tier="default", rpm=None, tpm=None, models=None, is_admin=False,
             created_at=NOW, revoked_at=None, token_quota=100, quota_period="day")


class Clocks:
    """The wall time periods are cut from, and the monotonic clock refreshes are timed by; both move when told."""

    def __init__(self) -> None:
        self.wall = NOW
        self.monotonic = 0.0

    def now(self) -> datetime:
        return self.wall

    def clock(self) -> float:
        return self.monotonic


def record(request_id: str, tokens: int, at: datetime = NOW, key_id: str = KEY.id) -> UsageRecord:
    return UsageRecord(request_id=request_id, key_id=key_id, model="m", prompt_tokens=tokens - tokens // 2,
                       completion_tokens=tokens // 2, created_at=at)


@pytest.fixture(name="recorder")
def recorder_fixture(db: Database) -> Iterator[UsageRecorder]:
    recorder = UsageRecorder(db, flush_interval=3600)  # flushed by the tests
    yield recorder
    recorder.close()


@pytest.fixture(name="clocks")
def clocks_fixture() -> Clocks:
    return Clocks()


def ledger_for(db: Database, recorder: UsageRecorder | None, clocks: Clocks) -> QuotaLedger:
    return QuotaLedger(db, recorder, refresh_seconds=5.0, now=clocks.now, clock=clocks.clock)


async def reread(ledger: QuotaLedger, clocks: Clocks) -> None:
    """Let the refresh interval pass, and wait for the read the next decision starts."""
    reads = ledger.reads
    clocks.monotonic += 5.0
    await ledger.state(KEY)
    while ledger.reads == reads:
        await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    ("period", "start", "end"),
    [
        ("day", datetime(2026, 11, 28, tzinfo=timezone.utc), datetime(2026, 11, 29, tzinfo=timezone.utc)),
        ("week", datetime(2026, 11, 23, tzinfo=timezone.utc), datetime(2026, 11, 30, tzinfo=timezone.utc)),
        ("month", datetime(2026, 11, 1, tzinfo=timezone.utc), datetime(2026, 12, 1, tzinfo=timezone.utc)),
        ("total", datetime(1970, 1, 1, tzinfo=timezone.utc), None),
    ],
)
def test_periods_are_utc_calendar_days_weeks_from_monday_and_months(
    period: str, start: datetime, end: datetime | None
) -> None:
    in_india = NOW.astimezone(timezone(timedelta(hours=5, minutes=30)))  # 21:00 the same day there
    assert period_start(period, in_india) == start
    assert period_end(period, start) == end


def test_a_december_month_ends_in_january_and_a_bad_period_is_refused() -> None:
    start = period_start("month", datetime(2026, 12, 31, 23, 59, tzinfo=timezone.utc))
    assert period_end("month", start) == datetime(2027, 1, 1, tzinfo=timezone.utc)
    with pytest.raises(ValueError, match="quota period must be one of day, week, month, total"):
        period_start("year", NOW)


def test_stored_use_counts_this_periods_records_of_this_key_only(
    db: Database, recorder: UsageRecorder, clocks: Clocks
) -> None:
    for request in (record("today", 60), record("yesterday", 1000, NOW - timedelta(days=1)),
                    record("other-key", 500, key_id="key_other")):
        recorder.record(request)
    recorder.flush()
    state = asyncio.run(ledger_for(db, recorder, clocks).state(KEY))
    assert (state.quota, state.used, state.held, state.remaining) == (100, 60, 0, 40)
    assert state.resets_at == datetime(2026, 11, 29, tzinfo=timezone.utc)
    assert asyncio.run(ledger_for(db, recorder, clocks).state(replace(KEY, token_quota=None))) is None


def test_running_requests_hold_their_reservation_and_their_use_counts_once_written_and_reread(
    db: Database, recorder: UsageRecorder, clocks: Clocks
) -> None:
    ledger = ledger_for(db, recorder, clocks)

    async def scenario() -> list[int | None]:
        used: list[int | None] = []
        _, first = await ledger.hold(KEY, 40)
        _, second = await ledger.hold(KEY, 50)
        spent, third = await ledger.hold(KEY, 1)  # 90 held of 100: still room
        _, fourth = await ledger.hold(KEY, 1)  # 91 held
        assert None not in (first, second, third, fourth) and not spent.spent
        ledger.release(third, "r3", 0)  # nothing used: nothing counted
        ledger.release(fourth, None, 0)
        ledger.release(first, "r1", 25)  # metered as r1, not yet recorded
        used.append((await ledger.state(KEY)).used)
        recorder.record(record("r1", 25))
        used.append((await ledger.state(KEY)).used)
        await asyncio.to_thread(recorder.flush)  # written: moved, not added
        used.append((await ledger.state(KEY)).used)
        await reread(ledger, clocks)
        state = await ledger.state(KEY)
        used.append(state.used)
        assert state.held == 50
        ledger.release(second, "r2", 80)
        state, refused = await ledger.hold(KEY, 1)
        used.append(state.used if refused is None else None)
        return used

    assert asyncio.run(scenario()) == [25, 25, 25, 25, 105]


def test_a_spent_quota_renews_when_the_period_turns_and_an_old_hold_counts_in_its_own_period(
    db: Database, recorder: UsageRecorder, clocks: Clocks
) -> None:
    recorder.record(record("big", 100))
    recorder.flush()
    ledger = ledger_for(db, recorder, clocks)

    async def scenario() -> tuple[bool, int, int]:
        state, refused = await ledger.hold(KEY, 1)
        assert refused is None and state.spent
        clocks.wall = NOW + timedelta(hours=9)  # 00:30 the next day
        state, hold = await ledger.hold(KEY, 30)
        assert hold is not None
        ledger.release(hold, "next-day", 30)
        yesterday_state, _ = await ledger.hold(replace(KEY, token_quota=10_000), 0)
        return state.spent, state.used, yesterday_state.used

    assert asyncio.run(scenario()) == (False, 0, 30)


def test_another_process_sees_the_use_once_written_and_refreshed(
    db: Database, recorder: UsageRecorder, clocks: Clocks
) -> None:
    here = ledger_for(db, recorder, clocks)
    other_db = open_database(db.url)
    there = ledger_for(other_db, None, clocks)

    async def scenario() -> list[int]:
        seen = [(await there.state(KEY)).used]
        _, hold = await here.hold(KEY, 10)
        here.release(hold, "here-1", 70)
        recorder.record(record("here-1", 70))
        await asyncio.to_thread(recorder.flush)
        seen.append((await there.state(KEY)).used)  # not reread yet
        await reread(there, clocks)
        seen.append((await there.state(KEY)).used)
        return seen

    try:
        assert asyncio.run(scenario()) == [0, 0, 70]
    finally:
        other_db.dispose()


def test_records_this_process_did_not_meter_are_counted_by_the_read_alone(
    db: Database, recorder: UsageRecorder, clocks: Clocks
) -> None:
    """Records a crashed run left in the journal are written at start: they must not count twice."""
    ledger = ledger_for(db, recorder, clocks)

    async def scenario() -> list[int]:
        used = [(await ledger.state(KEY)).used]
        recorder.record(record("recovered", 33))
        await asyncio.to_thread(recorder.flush)
        used.append((await ledger.state(KEY)).used)
        await reread(ledger, clocks)
        used.append((await ledger.state(KEY)).used)
        return used

    assert asyncio.run(scenario()) == [0, 0, 33]


def test_writes_racing_reads_never_count_a_record_twice_or_lose_it(db: Database, clocks: Clocks) -> None:
    recorder = UsageRecorder(db, flush_interval=0.001, max_batch=3)
    ledger = QuotaLedger(db, recorder, refresh_seconds=0.0, now=clocks.now, read_cost_factor=0.0)
    requests, tokens = 300, 7
    big = replace(KEY, token_quota=10**9)

    async def scenario() -> list[int]:
        seen = []
        for index in range(requests):
            _, hold = await ledger.hold(big, tokens)
            ledger.release(hold, f"r{index}", tokens)
            recorder.record(record(f"r{index}", tokens))
            seen.append((await ledger.state(big)).used)  # each call may start a read racing the writer
            await asyncio.sleep(0.001)
            if index % 10 == 0:  # and every tenth waits for one to end: reads race the writes however slow
                reads = ledger.reads  # the database commits (a slow disk made it 5 reads in 300 calls)
                while ledger.reads == reads:
                    seen.append((await ledger.state(big)).used)
                    await asyncio.sleep(0.001)
        await asyncio.to_thread(recorder.flush)
        reads = ledger.reads
        while ledger.reads < reads + 2:  # a read that began after the last write has ended
            await ledger.state(big)
            await asyncio.sleep(0.005)
        seen.append((await ledger.state(big)).used)
        return seen

    try:
        seen = asyncio.run(scenario())
    finally:
        recorder.close()
    assert ledger.reads > 20
    assert [used for used in seen[:-1] if not (0 < used <= requests * tokens)] == []
    assert seen[-1] == requests * tokens
    assert all(later >= earlier for earlier, later in zip(seen, seen[1:], strict=False))  # no read lost one


def test_a_key_whose_read_is_slow_is_reread_less_often(db: Database, recorder: UsageRecorder, clocks: Clocks) -> None:
    """A read taking 0.2 s puts the next one 50 x 0.2 = 10 s later, not at the 5 s of `refresh_seconds`."""
    ledger = ledger_for(db, recorder, clocks)

    def slow_query(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        if "sum(" in statement.lower():  # the read's query (not a connection's set-up statements)
            clocks.monotonic += 0.2

    event.listen(db.engine, "before_cursor_execute", slow_query)
    try:
        async def scenario() -> list[int]:
            reads = []
            await ledger.state(KEY)
            for elapsed in (6.0, 9.7, 10.3):
                clocks.monotonic = 0.2 + elapsed  # since the first read ended
                await ledger.state(KEY)
                await asyncio.sleep(0.05)
                while any(use.reading is not None for use in ledger._uses.values()):
                    await asyncio.sleep(0.01)
                reads.append(ledger.reads)
            return reads

        assert asyncio.run(scenario()) == [1, 1, 2]
    finally:
        event.remove(db.engine, "before_cursor_execute", slow_query)
