"""Usage metering: record every request's token counts off the request path, and report them with cost.

`UsageRecorder.record()` only appends to a buffer; a daemon thread writes the buffer every
`flush_interval` seconds (and sooner when `max_batch` records are waiting) with an insert that
ignores request ids already stored, so recording a request twice counts it once. `close()` writes
what is left, so a clean shutdown loses nothing. With a `Journal` (usage_journal.UsageJournal), every
record is also journaled on local disk before the response ends, and what a crash left in the
journal is written at the next start; without one, a crash loses at most the last interval.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from sqlalchemy import Insert, String, func, select
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, StatementError
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from llmserve.store.db import Database
from llmserve.store.schema import (
    ID_LENGTH,
    MODEL_NAME_LENGTH,
    REQUEST_ID_LENGTH,
    ApiKeyRow,
    UsageRecordRow,
    as_utc,
    utcnow,
)

if TYPE_CHECKING:
    from concurrent.futures import Future

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Journal(Protocol):
    """Where records are kept on local disk until they are in the database (usage_journal.UsageJournal)."""

    def recover(self) -> list[UsageRecord]: ...
    def start(self, request_id: str, key_id: str | None, model: str, prompt_tokens: int, at: datetime) -> None: ...
    def tokens(
        self, request_id: str, completion_tokens: int, cached_tokens: int, prompt_tokens: int | None = None
    ) -> None: ...
    def end(self, record: UsageRecord) -> Future[None] | None: ...
    def settled(self, request_ids: list[str]) -> None: ...
    def close(self) -> None: ...

GROUP_BY_CHOICES = ("model", "key", "day")
STATUS_LENGTH = 32


class UsageStatus:
    """How a request ended (any short string is accepted; these are the ones the server uses)."""

    COMPLETED = "completed"
    DISCONNECTED = "disconnected"  # the client went away; the tokens generated so far are counted
    ERROR = "error"
    FILTERED = "filtered"
    RATE_LIMITED = "rate_limited"
    INTERRUPTED = "interrupted"  # the server died mid-request; the tokens journaled so far are counted
    ABORTED_BY_SERVER = "aborted_by_server"  # still running when the shutdown timeout ran out


@dataclass(frozen=True)
class UsageRecord:
    request_id: str
    key_id: str | None  # None: local mode (no API keys)
    model: str
    prompt_tokens: int  # includes cached_tokens
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    status: str = UsageStatus.COMPLETED
    created_at: datetime = field(default_factory=utcnow)  # when the request arrived
    ttft_ms: float | None = None
    latency_ms: float | None = None

    def validate(self) -> None:
        """Raise ValueError for a record the database would refuse (checked up front so that one
        bad record cannot hold up a whole batch)."""
        _check_text("request_id", self.request_id, REQUEST_ID_LENGTH)
        _check_text("model", self.model, MODEL_NAME_LENGTH)
        _check_text("status", self.status, STATUS_LENGTH)
        if self.key_id is not None:
            _check_text("key_id", self.key_id, ID_LENGTH)
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"usage record {name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.created_at, datetime):
            raise ValueError(f"usage record created_at must be a datetime, got {self.created_at!r}")


def _check_text(name: str, value: object, max_length: int) -> None:
    if not isinstance(value, str) or not value or len(value) > max_length:
        raise ValueError(f"usage record {name} must be a non-empty string of at most {max_length} characters")


class UsageRecorder:
    """Buffers usage records in memory and writes them in batches from a background thread.

    `record()` is thread-safe and never touches the database. While the database is failing,
    records stay buffered (up to `max_buffered`, oldest dropped beyond that) and the next flush
    retries them. Counters: `written` (records handed to the database, duplicates included),
    `failed` (records the database refused, dropped), `dropped` (lost to the buffer limit or
    recorded after close), `flushes` (batches sent to the database).

    With a `journal`, records are journaled as they come and reported to it once in the database;
    the records a previous run left in it are buffered at once (call `flush()` to write them).
    """

    def __init__(
        self,
        db: Database,
        flush_interval: float = 1.0,
        max_batch: int = 1000,
        max_buffered: int = 1_000_000,
        journal: Journal | None = None,
    ) -> None:
        if flush_interval <= 0 or max_batch < 1 or max_buffered < max_batch:
            raise ValueError("need flush_interval > 0 and 1 <= max_batch <= max_buffered")
        self._db = db
        self._flush_interval = flush_interval
        self._max_batch = max_batch
        self._max_buffered = max_buffered
        self._buffer: deque[UsageRecord] = deque()
        self.journal = journal
        self._buffer_lock = threading.Lock()
        self._flush_lock = threading.Lock()  # one flush at a time keeps records in order
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._closed = False
        self._failing = False  # log an outage once, not every second
        self.written = 0
        self.failed = 0
        self.dropped = 0
        self.flushes = 0
        self._written_listeners: list[Callable[[Sequence[UsageRecord]], None]] = []
        if journal is not None:
            self._buffer.extend(journal.recover())
        self._thread = threading.Thread(target=self._flush_periodically, name="llmserve-usage-writer", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Records buffered and not yet written."""
        return len(self._buffer)

    def started(self, request_id: str, key_id: str | None, model: str, prompt_tokens: int, at: datetime) -> None:
        """Journal a request as running, so that a crash leaves it recorded as interrupted."""
        if self.journal is not None:
            self.journal.start(request_id, key_id, model, prompt_tokens, at)

    def progress(
        self, request_id: str, completion_tokens: int, cached_tokens: int, prompt_tokens: int | None = None
    ) -> None:
        """Journal a running request's token counts so far (its prompt's too, when it was not known at
        its start: a gateway learns it from the replica's first usage)."""
        if self.journal is not None:
            self.journal.tokens(request_id, completion_tokens, cached_tokens, prompt_tokens)

    def journal_end(self, record: UsageRecord) -> Future[None] | None:
        """Journal `record` ahead of `record()`; the future resolves once it is on disk (None: no journal,
        or journaled already). Raises ValueError for an invalid record."""
        record.validate()
        return self.journal.end(record) if self.journal is not None else None

    def record(self, record: UsageRecord) -> None:
        """Queue `record` for writing (and journal it, unless `journal_end` did). Non-blocking; raises
        ValueError for an invalid record."""
        self.journal_end(record)
        with self._buffer_lock:
            if self._closed:
                self.dropped += 1
                logger.warning("usage record %s arrived after the recorder closed; dropped", record.request_id)
                return
            if len(self._buffer) >= self._max_buffered:
                self._buffer.popleft()
                self.dropped += 1
            self._buffer.append(record)
            batch_ready = len(self._buffer) >= self._max_batch
        if batch_ready:
            self._wake.set()

    def add_written_listener(self, listener: Callable[[Sequence[UsageRecord]], None]) -> None:
        """Call `listener` with the records of each write, on the writing thread, once they are stored."""
        self._written_listeners.append(listener)

    def read_between_writes(self, read: Callable[[], T]) -> T:
        """Run `read` while no write is under way: what it reads of this recorder's records is exactly
        what the written listeners have been told of."""
        with self._flush_lock:
            return read()

    def flush(self) -> int:
        """Write everything buffered now (in this thread); returns how many records were written.

        On a database failure the unwritten records stay buffered for the next flush.
        """
        with self._flush_lock:
            written = 0
            while batch := self._take_batch():
                done, complete = self._write_batch(batch)
                written += done
                if not complete:
                    break
            return written

    def close(self) -> None:
        """Stop the background thread and write everything still buffered. Idempotent."""
        with self._buffer_lock:
            if self._closed:
                return
            self._closed = True
        self._stopping.set()
        self._wake.set()
        self._thread.join()
        self.flush()
        if self._buffer:
            kept = " (they stay in the usage journal for the next start)" if self.journal is not None else ""
            logger.error("%d usage records could not be written before shutdown%s", len(self._buffer), kept)
        if self.journal is not None:
            self.journal.close()

    def _flush_periodically(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self._flush_interval)
            self._wake.clear()
            if self._stopping.is_set():
                return  # close() does the final flush
            try:
                self.flush()
            except Exception:  # never let the writer thread die
                logger.exception("usage flush failed")

    def _take_batch(self) -> list[UsageRecord]:
        with self._buffer_lock:
            count = min(self._max_batch, len(self._buffer))
            return [self._buffer.popleft() for _ in range(count)]

    def _put_back(self, records: Sequence[UsageRecord]) -> None:
        with self._buffer_lock:
            self._buffer.extendleft(reversed(records))

    def _write_batch(self, batch: list[UsageRecord]) -> tuple[int, bool]:
        """Write one batch; returns (records written, whether the whole batch was dealt with)."""
        try:
            self._insert(batch)
        except (DataError, IntegrityError):
            return self._write_one_by_one(batch)
        except DBAPIError as exc:
            self._put_back(batch)
            self._note_outage(exc)
            return 0, False
        except StatementError:  # raised before reaching the database: something in the batch is bad
            return self._write_one_by_one(batch)
        self._note_recovery()
        self.written += len(batch)
        self._stored(batch)
        return len(batch), True

    def _write_one_by_one(self, batch: list[UsageRecord]) -> tuple[int, bool]:
        """Isolate the records the database refuses (dropping them) from the rest of the batch."""
        written = 0
        for index, record in enumerate(batch):
            try:
                self._insert([record])
            except (DataError, IntegrityError) as exc:
                self._drop_refused(record, exc)
            except DBAPIError as exc:
                self._put_back(batch[index:])
                self._note_outage(exc)
                return written, False
            except StatementError as exc:
                self._drop_refused(record, exc)
            else:
                self.written += 1
                written += 1
                self._stored([record])
        return written, True

    def _stored(self, records: Sequence[UsageRecord]) -> None:
        self._settled(records)
        for listener in self._written_listeners:
            try:
                listener(records)
            except Exception:  # a listener's failure must not lose or rewrite records
                logger.exception("a usage written-listener failed")

    def _settled(self, records: Sequence[UsageRecord]) -> None:
        if self.journal is not None:
            self.journal.settled([r.request_id for r in records])

    def _drop_refused(self, record: UsageRecord, exc: Exception) -> None:
        self._settled([record])  # the database would refuse it again
        self.failed += 1
        logger.error("usage record %s refused by the database, dropped: %s", record.request_id, exc)

    def _insert(self, records: Sequence[UsageRecord]) -> None:
        self.flushes += 1
        with self._db.session(write=True) as session:
            session.execute(_insert_ignoring_duplicates(self._db.dialect), [asdict(r) for r in records])

    def _note_outage(self, exc: Exception) -> None:
        if not self._failing:
            self._failing = True
            logger.warning("usage records kept in memory: the database write failed (%s); retrying", exc)

    def _note_recovery(self) -> None:
        if self._failing:
            self._failing = False
            logger.warning("usage writes to the database recovered")


def _insert_ignoring_duplicates(dialect: str) -> Insert:
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert(UsageRecordRow).on_conflict_do_nothing(index_elements=["request_id"])


@dataclass(frozen=True)
class Price:
    """USD per million tokens. Cached prompt tokens cost `cached_input_per_million` (None: the input price)."""

    input_per_million: float = 0.0
    cached_input_per_million: float | None = None
    output_per_million: float = 0.0

    @property
    def cached_rate(self) -> float:
        return self.input_per_million if self.cached_input_per_million is None else self.cached_input_per_million

    def cost_usd(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        cached = min(cached_tokens, prompt_tokens)
        return (
            (prompt_tokens - cached) * self.input_per_million
            + cached * self.cached_rate
            + completion_tokens * self.output_per_million
        ) / 1_000_000


class PriceTable:
    """Per-model prices; a model without an entry costs nothing."""

    _FIELDS = ("input_per_million", "cached_input_per_million", "output_per_million")

    def __init__(self, prices: Mapping[str, Price] | None = None) -> None:
        self._prices = dict(prices or {})

    @classmethod
    def from_dict(cls, raw: Mapping[str, Mapping[str, float]] | None) -> PriceTable:
        """From config: `{model: {input_per_million, cached_input_per_million, output_per_million}}`.

        Raises ValueError for unknown fields or prices that are not non-negative numbers.
        """
        prices = {}
        for model, entry in (raw or {}).items():
            unknown = set(entry) - set(cls._FIELDS)
            if unknown:
                raise ValueError(f"price for {model!r}: unknown fields {sorted(unknown)}; expected {list(cls._FIELDS)}")
            for name, value in entry.items():
                if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                    raise ValueError(f"price for {model!r}: {name} must be a non-negative number, got {value!r}")
            prices[model] = Price(**{name: float(value) for name, value in entry.items()})
        return cls(prices)

    def price(self, model: str) -> Price:
        return self._prices.get(model, Price())

    def cost_usd(self, model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        return self.price(model).cost_usd(prompt_tokens, cached_tokens, completion_tokens)


class UtcDay(FunctionElement[str]):
    """The UTC calendar day of a timestamp column as 'YYYY-MM-DD', on SQLite and PostgreSQL."""

    type = String()
    inherit_cache = True


@compiles(UtcDay, "sqlite")
def _utc_day_sqlite(element: UtcDay, compiler: SQLCompiler, **kw: Any) -> str:
    return f"date({compiler.process(element.clauses, **kw)})"  # stored as naive UTC text


@compiles(UtcDay, "postgresql")
def _utc_day_postgresql(element: UtcDay, compiler: SQLCompiler, **kw: Any) -> str:
    return f"to_char(({compiler.process(element.clauses, **kw)}) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"


@dataclass
class _Totals:
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    cost_usd: float = 0.0

    def add(self, other: _Totals) -> None:
        self.requests += other.requests
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.cached_tokens += other.cached_tokens
        self.cost_usd += other.cost_usd

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "cost_usd": round(self.cost_usd, 6),
        }


def query_usage(
    db: Database,
    *,
    start: datetime | None = None,
    end: datetime | None = None,
    group_by: str | None = None,
    key_id: str | None = None,
    prices: PriceTable | None = None,
) -> dict[str, Any]:
    """Usage between `start` (inclusive) and `end` (exclusive), summed in SQL.

    `key_id` limits it to one key (what a non-admin key may see); None means every key. Naive
    datetimes are UTC. `group_by` is "model", "key" (rows also carry `key_name`), "day" (UTC,
    'YYYY-MM-DD') or None (no `data` rows, only `total`). `input_tokens` includes
    `cached_tokens`. Raises ValueError for a bad group_by or a start after the end. Returns:
    {"object": "usage", "start", "end", "group_by", "data": [{"group", "requests", "input_tokens",
    "output_tokens", "cached_tokens", "cost_usd"}, ...], "total": {same fields but "group"}}.
    """
    if group_by not in (None, *GROUP_BY_CHOICES):
        raise ValueError(f"group_by must be one of {', '.join(GROUP_BY_CHOICES)}; got {group_by!r}")
    start = as_utc(start) if start is not None else None
    end = as_utc(end) if end is not None else None
    if start is not None and end is not None and start > end:
        raise ValueError("start must not be after end")
    prices = prices or PriceTable()

    groups: dict[Any, _Totals] = {}
    for group, model, totals in _sum_by_group_and_model(db, start, end, group_by, key_id):
        totals.cost_usd = prices.cost_usd(model, totals.input_tokens, totals.cached_tokens, totals.output_tokens)
        groups.setdefault(group, _Totals()).add(totals)

    total = _Totals()
    for totals in groups.values():
        total.add(totals)
    data = [{"group": group, **totals.as_dict()} for group, totals in sorted(groups.items(), key=_group_order)]
    if group_by == "key":
        names = _key_names(db, [row["group"] for row in data if row["group"] is not None])
        for row in data:
            row["key_name"] = names.get(row["group"])
    return {
        "object": "usage",
        "start": start.isoformat() if start else None,
        "end": end.isoformat() if end else None,
        "group_by": group_by,
        "data": data if group_by else [],
        "total": total.as_dict(),
    }


def _sum_by_group_and_model(
    db: Database, start: datetime | None, end: datetime | None, group_by: str | None, key_id: str | None
) -> list[tuple[Any, str, _Totals]]:
    record = UsageRecordRow
    group_column = {
        "model": record.model,
        "key": record.key_id,
        "day": UtcDay(record.created_at),
        None: None,
    }[group_by]
    # Cost depends on the model's price, so sum per (group, model) and price each sum in Python.
    keys = [record.model] if group_column is None or group_by == "model" else [group_column, record.model]
    query = select(
        *keys,
        func.count(),
        func.sum(record.prompt_tokens),
        func.sum(record.completion_tokens),
        func.sum(record.cached_tokens),
    ).group_by(*keys)
    if start is not None:
        query = query.where(record.created_at >= start)
    if end is not None:
        query = query.where(record.created_at < end)
    if key_id is not None:
        query = query.where(record.key_id == key_id)
    with db.session() as session:
        rows = session.execute(query).all()
    results = []
    for row in rows:
        *group_values, requests, prompt, completion, cached = row
        model = group_values[-1]
        group = group_values[0] if group_by else None
        results.append((group, model, _Totals(requests, int(prompt), int(completion), int(cached))))
    return results


def _group_order(item: tuple[Any, _Totals]) -> tuple[bool, str]:
    group = item[0]
    return (group is not None, "" if group is None else str(group))


def _key_names(db: Database, key_ids: list[str]) -> dict[str, str]:
    if not key_ids:
        return {}
    with db.session() as session:
        rows = session.execute(select(ApiKeyRow.id, ApiKeyRow.name).where(ApiKeyRow.id.in_(key_ids))).all()
    return {key: name for key, name in rows}
