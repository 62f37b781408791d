"""A local append-only journal of usage, so that neither a crash nor a kill loses a metered request.

Each server instance appends JSON lines to its own segment files in the journal directory
(`<instance>-<seq>.jsonl`), holding a lock on `<instance>.lock` while it runs:

    {"e": "start", "id", "key", "model", "prompt", "at"}    when the request is admitted
    {"e": "tokens", "id", "completion", "cached"[, "prompt"]} every few generated tokens (the prompt's
                                                            count when it was not known at the start)
    {"e": "end", "record": {UsageRecord fields}}            when the request ends

A writer thread writes whatever was appended since its last write in one go and, when an `end` in
it is waited for (a response about to send its last byte), fsyncs it: group commit, one fsync for
all the requests ending in the same moment. With `sync="write"` the waiter is released once the
lines are written to the file (the page cache: that survives a killed process, not a crashed
machine) and the fsync follows right after, off the response's path. A segment is deleted once every record it holds is in
the database; past `segment_bytes` a new segment starts, with the requests still running copied into
it. At start, the segments of instances that are gone (their lock is free) are read back: each
ended request as recorded, each started one without an end as `interrupted` with its last counts.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import threading
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any

from sqlalchemy.engine import URL

from llmserve.platform.usage import UsageRecord, UsageStatus
from llmserve.store.db import default_data_dir

logger = logging.getLogger(__name__)

SEGMENT_BYTES = 4 << 20
COLLECT_INTERVAL_S = 1.0  # how often the writer deletes segments whose records all reached the database
SYNC_MODES = ("fsync", "write")  # when a waited-for `end` counts as durable: on disk, or written to the file
_SEGMENT_NAME = re.compile(r"^(?P<instance>[0-9a-f-]+)-(?P<seq>\d+)\.jsonl$")


def default_journal_dir(database_url: URL) -> Path:
    """Next to a SQLite file (`<file>.usage-journal`); otherwise a directory per database in the data
    directory, so that servers of different databases never replay each other's records."""
    database = database_url.database
    if database_url.get_backend_name() == "sqlite" and database and database != ":memory:":
        path = Path(database).expanduser()
        return path.with_name(path.name + ".usage-journal")
    digest = hashlib.sha256(database_url.render_as_string(hide_password=True).encode()).hexdigest()[:16]
    return default_data_dir() / "usage-journal" / digest


@dataclass
class _Line:
    segment: Path
    data: bytes
    done: Future[None] | None  # resolved once the line is fsynced


class UsageJournal:
    """The journal of one server instance. All methods are thread-safe and never block on the disk,
    except `recover` and `close`."""

    def __init__(self, directory: Path, segment_bytes: int = SEGMENT_BYTES, sync: str = "fsync") -> None:
        if sync not in SYNC_MODES:
            raise ValueError(f"Unknown usage journal sync mode {sync!r}; use one of {', '.join(SYNC_MODES)}.")
        self._release_before_fsync = sync == "write"
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.directory = directory
        self._segment_bytes = segment_bytes
        self._instance = f"{os.getpid():x}-{secrets.token_hex(4)}"
        self._lock_files: dict[str, int] = {self._instance: _take_lock(directory / f"{self._instance}.lock")}
        self._lock = threading.Condition()
        self._lines: list[_Line] = []
        self._running: dict[str, dict[str, Any]] = {}  # started, not ended: the entries to copy on rotation
        self._unsettled: dict[Path, set[str]] = {}  # segment -> ids ended in it whose record is not in the DB
        self._segments_of: dict[str, list[Path]] = {}  # id -> the segments that must stay for it
        self._seq = 0
        self._segment = self._segment_path(self._instance, 0)
        self._unsettled[self._segment] = set()
        self._writing: Path | None = None  # the segment the writer appends to
        self._closed = False
        self.fsyncs = 0
        self._thread = threading.Thread(target=self._write_forever, name="llmserve-usage-journal", daemon=True)
        self._thread.start()

    # ---- appending ---------------------------------------------------------------------------------
    def start(self, request_id: str, key_id: str | None, model: str, prompt_tokens: int, at: datetime) -> None:
        entry = {"e": "start", "id": request_id, "key": key_id, "model": model, "prompt": prompt_tokens,
                 "at": at.isoformat()}
        with self._lock:
            self._running[request_id] = entry
            self._append(entry, None)

    def tokens(
        self, request_id: str, completion_tokens: int, cached_tokens: int, prompt_tokens: int | None = None
    ) -> None:
        with self._lock:
            running = self._running.get(request_id)
            if running is None:
                return
            running["completion"], running["cached"] = completion_tokens, cached_tokens
            entry = {"e": "tokens", "id": request_id, "completion": completion_tokens, "cached": cached_tokens}
            if prompt_tokens is not None and prompt_tokens != running["prompt"]:
                running["prompt"] = entry["prompt"] = prompt_tokens
            self._append(entry, None)

    def end(self, record: UsageRecord) -> Future[None] | None:
        """Journal `record`; the future resolves once it is on disk (None: it already was journaled)."""
        done: Future[None] = Future()
        with self._lock:
            if record.request_id in self._segments_of and record.request_id not in self._running:
                return None
            self._running.pop(record.request_id, None)
            if self._closed:
                return None
            self._hold(record.request_id, self._segment)
            fields = asdict(record)
            fields["created_at"] = record.created_at.isoformat()
            self._append({"e": "end", "record": fields}, done)
        return done

    def settled(self, request_ids: list[str]) -> None:
        """These records are in the database: their segments need not keep them."""
        with self._lock:
            for request_id in request_ids:
                for segment in self._segments_of.pop(request_id, ()):
                    self._unsettled.get(segment, set()).discard(request_id)

    def _hold(self, request_id: str, segment: Path) -> None:
        segments = self._segments_of.setdefault(request_id, [])
        if segment not in segments:
            segments.append(segment)
            self._unsettled.setdefault(segment, set()).add(request_id)

    def _append(self, entry: dict[str, Any], done: Future[None] | None) -> None:
        if self._closed:
            return
        self._lines.append(_Line(self._segment, json.dumps(entry, separators=(",", ":")).encode() + b"\n", done))
        self._lock.notify()

    # ---- recovery ----------------------------------------------------------------------------------
    def recover(self) -> list[UsageRecord]:
        """The records journaled by instances that are gone (kept until `settled`): ended requests as
        they were recorded, started ones without an end as `interrupted`."""
        records: list[UsageRecord] = []
        for instance in self._dead_instances():
            segments = sorted(self._segments_of_instance(instance), key=_seq_of)
            for request_id, record in _read_segments(segments).items():
                if record is None:
                    continue
                try:
                    record.validate()
                except ValueError as exc:
                    logger.error("usage journal: skipping record %s: %s", request_id, exc)
                    continue
                records.append(record)
                with self._lock:
                    for segment in segments:
                        self._hold(request_id, segment)
            with self._lock:
                for segment in segments:
                    self._unsettled.setdefault(segment, set())
        if records:
            logger.warning("usage journal: recovered %d usage records from a previous run", len(records))
        return records

    def _dead_instances(self) -> list[str]:
        dead = []
        for lock_path in sorted(self.directory.glob("*.lock")):
            instance = lock_path.stem
            if instance in self._lock_files:
                continue
            try:
                self._lock_files[instance] = _take_lock(lock_path)
            except BlockingIOError:
                continue  # a running server's journal
            dead.append(instance)
        return dead

    def _segments_of_instance(self, instance: str) -> list[Path]:
        return [
            path for path in self.directory.glob(f"{instance}-*.jsonl")
            if (match := _SEGMENT_NAME.match(path.name)) and match["instance"] == instance
        ]

    # ---- the writer --------------------------------------------------------------------------------
    def _write_forever(self) -> None:
        file: IO[bytes] | None = None
        while True:
            with self._lock:
                if not self._lines and not self._closed:
                    self._lock.wait(COLLECT_INTERVAL_S)
                lines, self._lines = self._lines, []
                stopping = self._closed
            try:
                file = self._write(lines, file)
            except OSError as exc:
                logger.error("usage journal: cannot write to %s: %s", self.directory, exc)
                for line in lines:
                    if line.done is not None and not line.done.done():
                        line.done.set_exception(exc)
            if file is not None and file.tell() >= self._segment_bytes:
                self._rotate()
            self._delete_settled_segments()
            if stopping and not self._lines:
                if file is not None:
                    file.close()
                return

    def _write(self, lines: list[_Line], file: IO[bytes] | None) -> IO[bytes] | None:
        waiting = []
        for line in lines:
            if file is None or line.segment != self._writing:
                file = self._switch_to(line.segment, file)
            file.write(line.data)
            if line.done is not None:
                waiting.append(line.done)
        if file is not None:
            file.flush()  # in the page cache: survives a killed process
            if waiting and self._release_before_fsync:
                _release(waiting)
            if waiting:
                os.fdatasync(file.fileno())  # on disk: survives a crashed machine
                self.fsyncs += 1
        _release(waiting)
        return file

    def _switch_to(self, segment: Path, file: IO[bytes] | None) -> IO[bytes]:
        if file is not None:
            file.flush()
            os.fdatasync(file.fileno())  # the copies in the new segment may be all that is left of a request
            file.close()
        descriptor = os.open(segment, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with self._lock:
            self._writing = segment
        return os.fdopen(descriptor, "ab")

    def _rotate(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._seq += 1
            self._segment = self._segment_path(self._instance, self._seq)
            self._unsettled[self._segment] = set()
            for entry in self._running.values():
                self._append(entry, None)

    def _delete_settled_segments(self) -> None:
        with self._lock:
            done = [
                segment for segment, ids in self._unsettled.items()
                if not ids and segment not in (self._segment, self._writing)
            ]
            for segment in done:
                del self._unsettled[segment]
            instances_left = {_instance_of(segment) for segment in self._unsettled}
        for segment in done:
            segment.unlink(missing_ok=True)
        for instance in [i for i in self._lock_files if i != self._instance and i not in instances_left]:
            (self.directory / f"{instance}.lock").unlink(missing_ok=True)
            os.close(self._lock_files.pop(instance))

    # ---- closing -----------------------------------------------------------------------------------
    @property
    def everything_settled(self) -> bool:
        with self._lock:
            return not self._running and not any(self._unsettled.values())

    def close(self) -> None:
        """Write what is pending and stop. With every record in the database and nothing running, the
        journal's files are deleted; otherwise they stay for the next start to recover."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify()
        self._thread.join()
        if self.everything_settled:
            for segment in list(self._unsettled):
                segment.unlink(missing_ok=True)
            for instance in list(self._lock_files):
                (self.directory / f"{instance}.lock").unlink(missing_ok=True)
        for descriptor in self._lock_files.values():
            os.close(descriptor)
        self._lock_files.clear()

    def _segment_path(self, instance: str, seq: int) -> Path:
        return self.directory / f"{instance}-{seq}.jsonl"


def _release(waiting: list[Future[None]]) -> None:
    for done in waiting:
        if not done.done():
            done.set_result(None)


def _take_lock(path: Path) -> int:
    """Open and lock `path` (raises BlockingIOError while another process holds it)."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def _seq_of(segment: Path) -> int:
    match = _SEGMENT_NAME.match(segment.name)
    return int(match["seq"]) if match else 0


def _instance_of(segment: Path) -> str:
    match = _SEGMENT_NAME.match(segment.name)
    return match["instance"] if match else ""


def _read_segments(segments: list[Path]) -> dict[str, UsageRecord | None]:
    """Every request in `segments` (in order) as its final record, or `interrupted` if it never ended."""
    started: dict[str, dict[str, Any]] = {}
    ended: dict[str, UsageRecord | None] = {}
    for segment in segments:
        with segment.open("rb") as file:
            for number, raw in enumerate(file, 1):
                try:
                    entry = json.loads(raw)
                    _apply(entry, started, ended)
                except (ValueError, KeyError, TypeError) as exc:  # a torn last line, or garbage
                    logger.warning("usage journal: skipping line %d of %s: %s", number, segment.name, exc)
    for request_id, entry in started.items():
        if request_id not in ended:
            ended[request_id] = _interrupted(entry)
    return ended


def _apply(entry: dict[str, Any], started: dict[str, dict[str, Any]], ended: dict[str, UsageRecord | None]) -> None:
    kind, request_id = entry["e"], entry.get("id")
    if kind == "end":
        fields = dict(entry["record"])
        fields["created_at"] = datetime.fromisoformat(fields["created_at"])
        ended[fields["request_id"]] = UsageRecord(**fields)
    elif kind == "start":
        started.setdefault(request_id, {}).update(entry)
    elif kind == "tokens" and request_id in started:
        started[request_id].update(completion=entry["completion"], cached=entry["cached"])
        if "prompt" in entry:
            started[request_id]["prompt"] = entry["prompt"]


def _interrupted(entry: dict[str, Any]) -> UsageRecord:
    return UsageRecord(
        request_id=entry["id"],
        key_id=entry["key"],
        model=entry["model"],
        prompt_tokens=entry["prompt"],
        completion_tokens=entry.get("completion", 0),
        cached_tokens=entry.get("cached", 0),
        status=UsageStatus.INTERRUPTED,
        created_at=datetime.fromisoformat(entry["at"]),
    )
