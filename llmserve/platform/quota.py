"""Per-key token quotas: a budget of tokens (prompt plus completion) per UTC day, week or month, or in total.

A key's use in its current period is what the database's usage records say, read at most every
`refresh_seconds` off the request path, plus what this process metered since that read, plus what
its running requests hold (each holds its reservation, prompt plus `max_tokens`, until it ends). A
request is admitted while that sum is under the quota; so one request may overshoot it by its own
size, never more in one process. Replicas sharing a database see each other's use once it is
written and read: the usage writer's interval plus `refresh_seconds`, or longer for a key whose read
is slow (a million records in its period take 0.1-0.3 s), which is reread no sooner than
READ_COST_FACTOR times its last read took.

The read and this process's writes never overlap (`UsageRecorder.read_between_writes`), so a record
is counted once: the writer reports the records it wrote (`written`), and what was written after
the last read moves from "metered here, not yet stored" to "stored since the read".
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Literal, Protocol, get_args

from sqlalchemy import func, select

from llmserve.store.schema import UsageRecordRow

if TYPE_CHECKING:
    from llmserve.platform.usage import UsageRecord, UsageRecorder
    from llmserve.store.db import Database

QuotaPeriod = Literal["day", "week", "month", "total"]
QUOTA_PERIODS: tuple[str, ...] = get_args(QuotaPeriod)
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
READ_COST_FACTOR = 50  # a key's use is reread no sooner than this many times its last read took

logger = logging.getLogger(__name__)


class QuotaKey(Protocol):
    """What the ledger reads of a key (keys.ApiKey)."""

    @property
    def id(self) -> str: ...
    @property
    def token_quota(self) -> int | None: ...
    @property
    def quota_period(self) -> str | None: ...


def period_start(period: str, now: datetime) -> datetime:
    """The UTC start of the period holding `now` (weeks start on Monday; "total" never restarts)."""
    now = now.astimezone(timezone.utc)
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return day
    if period == "week":
        return day - timedelta(days=day.weekday())
    if period == "month":
        return day.replace(day=1)
    if period == "total":
        return _EPOCH
    raise ValueError(f"quota period must be one of {', '.join(QUOTA_PERIODS)}, got {period!r}")


def period_end(period: str, start: datetime) -> datetime | None:
    """When the period that began at `start` ends (None: "total" never does)."""
    if period == "day":
        return start + timedelta(days=1)
    if period == "week":
        return start + timedelta(days=7)
    if period == "month":
        return start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return None


@dataclass(frozen=True)
class QuotaState:
    """A key's quota as a decision sees it."""

    quota: int
    period: str
    used: int  # stored, plus metered here since the last read
    held: int  # reserved by this process's running requests
    resets_at: datetime | None

    @property
    def remaining(self) -> int:
        return max(0, self.quota - self.used)

    @property
    def spent(self) -> bool:
        return self.used + self.held >= self.quota

    def as_dict(self) -> dict[str, object]:
        return {
            "tokens": self.quota,
            "period": self.period,
            "used": self.used,
            "remaining": self.remaining,
            "resets_at": self.resets_at.isoformat() if self.resets_at is not None else None,
        }


@dataclass
class _KeyUse:
    """One key's use in one period, as this process knows it."""

    start: datetime
    stored: int = 0  # in the database at the last read
    stored_since_read: int = 0  # this process's records written after the last read
    unstored: dict[str, int] = field(default_factory=dict)  # request id -> tokens metered here, not yet written
    held: int = 0
    read_at: float | None = None  # monotonic; None: never read
    read_seconds: float = 0.0  # how long the last read took
    reading: asyncio.Future[None] | None = None

    @property
    def used(self) -> int:
        return self.stored + self.stored_since_read + sum(self.unstored.values())


@dataclass(eq=False)
class QuotaHold:
    """The tokens a running request holds against its key's quota until it ends."""

    key_id: str
    start: datetime
    tokens: int
    released: bool = False


class QuotaLedger:
    """Every key's use of its quota in its current period; one per process, used from one event loop
    (the usage writer thread reports writes through `written`, which takes the lock)."""

    def __init__(
        self,
        db: Database,
        recorder: UsageRecorder | None,
        refresh_seconds: float = 5.0,
        read_cost_factor: float = READ_COST_FACTOR,
        now: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._db = db
        self._recorder = recorder
        self._refresh_seconds = refresh_seconds
        self._read_cost_factor = read_cost_factor
        self._now = now
        self._clock = clock
        self._uses: dict[str, _KeyUse] = {}
        self._lock = threading.Lock()  # `written` runs on the usage writer's thread
        self.reads = 0  # database reads made, for tests
        if recorder is not None:
            recorder.add_written_listener(self.written)

    async def state(self, key: QuotaKey) -> QuotaState | None:
        """The key's quota now (None: it has none); reads the database first when this period's use
        is not known yet, and refreshes it in the background when the last read is old."""
        if key.token_quota is None:
            return None
        period = key.quota_period or "total"
        use = await self._current(key.id, period)
        with self._lock:
            return QuotaState(key.token_quota, period, use.used, use.held, period_end(period, use.start))

    async def hold(self, key: QuotaKey, tokens: int) -> tuple[QuotaState | None, QuotaHold | None]:
        """Hold `tokens` of the key's quota for a request, unless its quota is spent (held: None)."""
        state = await self.state(key)
        if state is None or state.spent:
            return state, None
        with self._lock:
            use = self._uses[key.id]
            use.held += tokens
        return state, QuotaHold(key.id, use.start, tokens)

    def release(self, hold: QuotaHold, request_id: str | None, used_tokens: int) -> None:
        """The request ended having used `used_tokens`, metered under `request_id` (None: nothing
        metered, as for a request refused before it ran)."""
        if hold.released:
            return
        hold.released = True
        with self._lock:
            use = self._uses.get(hold.key_id)
            if use is None or use.start != hold.start:  # the period turned meanwhile: its use is history
                return
            use.held -= hold.tokens
            if request_id is not None and used_tokens > 0:
                use.unstored[request_id] = used_tokens

    def written(self, records: Sequence[UsageRecord]) -> None:
        """The usage writer stored `records` (called on its thread, between reads)."""
        with self._lock:
            for record in records:
                use = self._uses.get(record.key_id or "")
                if use is not None and record.request_id in use.unstored:
                    use.stored_since_read += use.unstored.pop(record.request_id)

    async def _current(self, key_id: str, period: str) -> _KeyUse:
        start = period_start(period, self._now())
        with self._lock:
            use = self._uses.get(key_id)
            if use is None or use.start != start:
                use = self._uses[key_id] = _KeyUse(start)
        if use.read_at is None:  # nothing known of this period yet: wait for the database
            await asyncio.shield(self._reading(key_id, use))
        elif self._clock() - use.read_at >= self._refresh_interval(use) and use.reading is None:
            self._reading(key_id, use).add_done_callback(self._note_failed_refresh)
        return use

    def _refresh_interval(self, use: _KeyUse) -> float:
        """`refresh_seconds`, or longer for a key whose reads are slow (many records in its period), so
        that refreshing one key never takes more than 1/read_cost_factor of a database connection's time."""
        return max(self._refresh_seconds, self._read_cost_factor * use.read_seconds)

    def _reading(self, key_id: str, use: _KeyUse) -> asyncio.Future[None]:
        """The read of the key's stored use now under way, started if none is (concurrent callers share it)."""
        if use.reading is None:
            use.reading = asyncio.ensure_future(asyncio.to_thread(self._read_stored, key_id, use))
            use.reading.add_done_callback(lambda _: setattr(use, "reading", None))
        return use.reading

    @staticmethod
    def _note_failed_refresh(reading: asyncio.Future[None]) -> None:
        if not reading.cancelled() and reading.exception() is not None:  # decisions go on with the last read
            logger.warning("could not refresh a key's quota use: %s", reading.exception())

    def _read_stored(self, key_id: str, use: _KeyUse) -> None:
        def read() -> None:
            started = self._clock()
            query = select(func.coalesce(func.sum(UsageRecordRow.prompt_tokens + UsageRecordRow.completion_tokens), 0))
            query = query.where(UsageRecordRow.key_id == key_id, UsageRecordRow.created_at >= use.start)
            with self._db.session() as session:
                stored = int(session.scalar(query))
            with self._lock:
                use.stored, use.stored_since_read, use.read_at = stored, 0, self._clock()
                use.read_seconds = use.read_at - started
            self.reads += 1

        if self._recorder is not None:
            self._recorder.read_between_writes(read)
        else:
            read()
