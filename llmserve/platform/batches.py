"""The Batch API's storage (OpenAI's /v1/files and /v1/batches): uploaded files, batches of requests over one of
them, and each request's result as it comes, in the database, so that a batch survives its server's restart and any
server sharing the database may run it.

A batch is run by one server at a time: the one holding its lease (`claim`, kept by `renew`). A server that dies
stops renewing, and once the lease has run out another server (or the same one, restarted) takes the batch over and
runs the requests that have no result yet. The output and error files are written once, at the end (`finish`).

Every method is one short transaction, safe from any thread; `key_id` is the caller's key (None in local mode), and
another key's file or batch raises FileNotFound or BatchNotFound, as an unknown one.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, TypeVar

from sqlalchemy import ColumnElement, and_, delete, or_, select, update
from sqlalchemy.orm import Session

from llmserve.errors import InvalidRequestError, LLMServeError
from llmserve.platform.metadata import checked_metadata
from llmserve.store.db import Database
from llmserve.store.schema import BatchResultRow, BatchRow, FileRow, utcnow

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/moderations",
             "/v1/messages")
COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
UPLOAD_PURPOSES = ("batch",)
OUTPUT_PURPOSE = "batch_output"
MAX_REQUESTS = 50_000  # per batch, as OpenAI's
MAX_PAGE_SIZE = 10_000  # OpenAI's bound on a page of files
# A file's `expires_after` (and a batch's `output_expires_after`) in seconds, within OpenAI's bounds; a batch's input
# and output files are kept this long unless asked otherwise, as OpenAI keeps them.
MIN_EXPIRES_AFTER, MAX_EXPIRES_AFTER = 3600, 30 * 24 * 3600
DEFAULT_EXPIRES_AFTER = MAX_EXPIRES_AFTER
MAX_CUSTOM_ID_CHARS = 512
R = TypeVar("R", FileRow, BatchRow)
# Running, a batch is in one of these; the others are final.
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
BatchStatus = Literal["validating", "in_progress", "finalizing", "cancelling", "completed", "failed", "expired",
                      "cancelled"]


class FileNotFound(LLMServeError):
    def __init__(self, file_id: str) -> None:
        super().__init__(f"No such File object: {file_id}")
        self.file_id = file_id


class BatchNotFound(LLMServeError):
    def __init__(self, batch_id: str) -> None:
        super().__init__(f"No batch found with id '{batch_id}'.")
        self.batch_id = batch_id


class FileInUse(LLMServeError):
    """A file that an unfinished batch reads its requests from."""


class BatchNotCancellable(LLMServeError):
    """A batch that has already ended."""


class BatchNotEnded(LLMServeError):
    """A batch that has not ended yet (it cannot be deleted)."""


@dataclass(frozen=True)
class BatchRequest:
    """One line of a batch's input file."""

    line: int  # from 0
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class ClaimedBatch:
    """A batch this server holds the lease on, as it was when claimed."""

    id: str
    key_id: str | None
    endpoint: str
    input_file_id: str
    status: BatchStatus
    expires_at: datetime


def _unix(moment: datetime | None) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


def _owned_by(column: Any, key_id: str | None) -> ColumnElement[bool]:
    # Local mode (no keys) owns exactly what was made without a key.
    return column.is_(None) if key_id is None else column == key_id


def file_object(row: FileRow) -> dict[str, Any]:
    return {"id": row.id, "object": "file", "bytes": row.bytes, "created_at": _unix(row.created_at),
            "expires_at": _unix(row.expires_at), "filename": row.filename, "purpose": row.purpose,
            "status": "processed", "status_details": None}


def check_expires_after(seconds: int, param: str) -> int:
    if not MIN_EXPIRES_AFTER <= seconds <= MAX_EXPIRES_AFTER:
        raise InvalidRequestError(f"{param} must be between {MIN_EXPIRES_AFTER} and {MAX_EXPIRES_AFTER} seconds "
                                  f"(an hour and 30 days), got {seconds}.", param=param)
    return seconds


def _unexpired(now: datetime) -> ColumnElement[bool]:
    return or_(FileRow.expires_at.is_(None), FileRow.expires_at > now)


def _expiry(created_at: datetime, seconds: int | None) -> datetime | None:
    return created_at + timedelta(seconds=seconds) if seconds is not None else None


def batch_object(row: BatchRow) -> dict[str, Any]:
    errors = {"object": "list", "data": row.errors} if row.errors else None
    return {
        "id": row.id, "object": "batch", "endpoint": row.endpoint, "errors": errors,
        "input_file_id": row.input_file_id, "completion_window": row.completion_window, "status": row.status,
        "output_file_id": row.output_file_id, "error_file_id": row.error_file_id,
        "created_at": _unix(row.created_at), "in_progress_at": _unix(row.in_progress_at),
        "expires_at": _unix(row.expires_at), "finalizing_at": _unix(row.finalizing_at),
        "completed_at": _unix(row.completed_at), "failed_at": _unix(row.failed_at),
        "expired_at": _unix(row.expired_at), "cancelling_at": _unix(row.cancelling_at),
        "cancelled_at": _unix(row.cancelled_at),
        "request_counts": {"total": row.total, "completed": row.completed, "failed": row.failed},
        "usage": row.usage,
        "metadata": row.metadata_,
    }


def _owned_row(session: Session, table: type[R], key_id: str | None, row_id: str,
               not_found: Callable[[str], Exception]) -> R:
    """The row with this id if the key owns it; `not_found(row_id)` raised otherwise, as for an unknown id."""
    row = session.get(table, row_id)
    if row is None or row.key_id != key_id:
        raise not_found(row_id)
    return row


def _beyond(table: Any, anchor: Any, ascending: bool) -> ColumnElement[bool]:
    """The rows after `anchor` in (created_at, id) order, or before it when not `ascending`."""
    if ascending:
        return or_(table.created_at > anchor.created_at, and_(table.created_at == anchor.created_at, table.id > anchor.id))
    return or_(table.created_at < anchor.created_at, and_(table.created_at == anchor.created_at, table.id < anchor.id))


def _page(rows: list[Any], limit: int, to_object: Any) -> tuple[list[dict[str, Any]], bool]:
    return [to_object(row) for row in rows[:limit]], len(rows) > limit


def _check_limit(limit: int, most: int) -> None:
    if not 1 <= limit <= most:
        raise InvalidRequestError(f"limit must be between 1 and {most}, got {limit}", param="limit")


class FileStore:
    def __init__(self, db: Database, max_bytes: int) -> None:
        self._db = db
        self.max_bytes = max_bytes

    def create(self, key_id: str | None, filename: str, purpose: str, content: bytes,
               expires_after: int = DEFAULT_EXPIRES_AFTER) -> dict[str, Any]:
        """Keep an uploaded file for `expires_after` seconds. Raises InvalidRequestError for a purpose other than
        "batch", an empty file, one over `max_bytes`, or a time to keep it outside OpenAI's bounds."""
        check_expires_after(expires_after, "expires_after.seconds")
        if purpose not in UPLOAD_PURPOSES:
            raise InvalidRequestError(
                f"Invalid purpose {purpose!r}: this server keeps files for batches only (purpose 'batch').",
                param="purpose")
        if not content:
            raise InvalidRequestError("The file is empty.", param="file")
        if len(content) > self.max_bytes:
            raise InvalidRequestError(f"The file is {len(content)} bytes, over this server's limit of "
                                      f"{self.max_bytes}.", param="file")
        now = utcnow()
        row = FileRow(id=f"file-{secrets.token_hex(12)}", key_id=key_id, filename=filename[:200] or "upload",
                      purpose=purpose, bytes=len(content), content=content, created_at=now,
                      expires_at=_expiry(now, expires_after))
        with self._db.session(write=True) as session:
            session.add(row)
            return file_object(row)

    def get(self, key_id: str | None, file_id: str) -> dict[str, Any]:
        with self._db.session() as session:
            return file_object(self._row(session, key_id, file_id))

    def content(self, key_id: str | None, file_id: str) -> bytes:
        with self._db.session() as session:
            return self._row(session, key_id, file_id).content

    def list(self, key_id: str | None, purpose: str | None = None, limit: int = MAX_PAGE_SIZE,
             after: str | None = None, order: Literal["asc", "desc"] = "desc") -> tuple[list[dict[str, Any]], bool]:
        """A page of the key's files, newest first unless `order=asc`; `after` is the last id of the page before."""
        _check_limit(limit, MAX_PAGE_SIZE)
        columns = (FileRow.id, FileRow.key_id, FileRow.filename, FileRow.purpose, FileRow.bytes, FileRow.created_at,
                   FileRow.expires_at)
        query = select(*columns).where(_owned_by(FileRow.key_id, key_id), _unexpired(utcnow()))
        if purpose is not None:
            query = query.where(FileRow.purpose == purpose)
        ascending = order == "asc"
        with self._db.session() as session:
            if after is not None:
                anchor = session.get(FileRow, after)
                if anchor is None or anchor.key_id != key_id:
                    raise InvalidRequestError(f"No file with id {after!r}.", param="after")
                query = query.where(_beyond(FileRow, anchor, ascending))
            keys = (FileRow.created_at, FileRow.id) if ascending else (FileRow.created_at.desc(), FileRow.id.desc())
            rows = session.execute(query.order_by(*keys).limit(limit + 1)).all()
        return _page(list(rows), limit, file_object)

    def delete(self, key_id: str | None, file_id: str) -> None:
        """Raises FileInUse while an unfinished batch reads its requests from the file."""
        with self._db.session(write=True) as session:
            row = self._row(session, key_id, file_id)
            reader = session.scalars(select(BatchRow.id).where(
                BatchRow.input_file_id == file_id, BatchRow.status.in_(UNFINISHED))).first()
            if reader is not None:
                raise FileInUse(f"File {file_id} is the input of batch {reader}, which has not ended; cancel it or "
                                "wait for it to end.")
            session.delete(row)

    def purge_expired(self) -> int:
        """Delete the files past their expiry, but for the input of a batch that has not ended (its runner may
        have to read it again); how many."""
        read = select(BatchRow.input_file_id).where(BatchRow.status.in_(UNFINISHED))
        with self._db.session(write=True) as session:
            return session.execute(delete(FileRow).where(
                FileRow.expires_at <= utcnow(), FileRow.id.not_in(read))).rowcount

    @staticmethod
    def _row(session: Session, key_id: str | None, file_id: str) -> FileRow:
        """The key's file; FileNotFound for an unknown id, another key's file or an expired one."""
        row = _owned_row(session, FileRow, key_id, file_id, FileNotFound)
        if row.expires_at is not None and row.expires_at <= utcnow():
            raise FileNotFound(file_id)
        return row


def _line_error(line: int, message: str, param: str | None = None, code: str = "invalid_request") -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line + 1}


def parse_requests(content: bytes, endpoint: str | None) -> tuple[list[BatchRequest], list[dict[str, Any]]]:
    """The requests of a batch's input file (JSON Lines, one request a line), or the errors that make it invalid,
    each naming its line (from 1), as OpenAI's batch `errors` do. Every line's `url` is `endpoint`, or with None
    (`llmserve run-batch`) any of ENDPOINTS."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        return [], [_line_error(0, "The file is not UTF-8 text.", code="invalid_file")]
    requests: list[BatchRequest] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for line, raw in enumerate(text.splitlines()):
        if not raw.strip():
            continue
        request = _parse_line(line, raw, endpoint, seen, errors)
        if request is not None:
            requests.append(request)
    if not requests and not errors:
        errors.append(_line_error(0, "The file has no requests.", code="empty_file"))
    if len(requests) > MAX_REQUESTS:
        errors.append(_line_error(0, f"A batch holds at most {MAX_REQUESTS} requests; the file has {len(requests)}.",
                                  code="too_many_requests"))
    return requests, errors[:100]


def _parse_line(line: int, raw: str, endpoint: str | None, seen: set[str],
                errors: list[dict[str, Any]]) -> BatchRequest | None:
    try:
        item = json.loads(raw)
    except (ValueError, RecursionError):
        errors.append(_line_error(line, "The line is not valid JSON.", code="invalid_json_line"))
        return None
    if not isinstance(item, dict):
        errors.append(_line_error(line, "The line is not a JSON object.", code="invalid_json_line"))
        return None
    unknown = sorted(set(item) - {"custom_id", "method", "url", "body"})
    custom_id, method, url, body = (item.get(name) for name in ("custom_id", "method", "url", "body"))
    problem = (
        (f"Unknown field {unknown[0]!r}.", unknown[0]) if unknown else
        ("custom_id must be a non-empty string.", "custom_id")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS else
        (f"custom_id {custom_id!r} is not unique in the file.", "custom_id") if custom_id in seen else
        ("method must be 'POST'.", "method") if method != "POST" else
        (f"url must be the batch's endpoint, {endpoint!r}.", "url") if endpoint is not None and url != endpoint else
        (f"url must be one of {', '.join(ENDPOINTS)}.", "url") if url not in ENDPOINTS else
        ("body must be a JSON object.", "body") if not isinstance(body, dict) else
        ("Streaming is not supported in a batch.", "body.stream") if body.get("stream") else
        None
    )
    if problem is not None:
        errors.append(_line_error(line, problem[0], problem[1]))
        return None
    seen.add(custom_id)
    return BatchRequest(line, custom_id, url, body)


def result_record(custom_id: str, status_code: int, request_id: str, body: Any) -> dict[str, Any]:
    """A line of the output or error file: a request's answer, in OpenAI's shape."""
    return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body}, "error": None}


def unanswered_record(custom_id: str, code: str, message: str) -> dict[str, Any]:
    """A line of the error file for a request that never ran (the batch expired or was cancelled first)."""
    return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def _usage(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The tokens of a batch's answers, in the shape of OpenAI's batch `usage` (the answers' usage is chat's and
    completions' `prompt_tokens`, or the Responses API's `input_tokens`)."""
    spent = {"input": 0, "cached": 0, "output": 0, "reasoning": 0}
    for record in records:
        usage = (record["response"]["body"] or {}).get("usage") or {}
        inputs = usage.get("input_tokens_details") or usage.get("prompt_tokens_details") or {}
        outputs = usage.get("output_tokens_details") or usage.get("completion_tokens_details") or {}
        spent["input"] += usage.get("input_tokens", usage.get("prompt_tokens", 0)) or 0
        spent["output"] += usage.get("output_tokens", usage.get("completion_tokens", 0)) or 0
        spent["cached"] += inputs.get("cached_tokens") or 0
        spent["reasoning"] += outputs.get("reasoning_tokens") or 0
    return {"input_tokens": spent["input"], "input_tokens_details": {"cached_tokens": spent["cached"]},
            "output_tokens": spent["output"], "output_tokens_details": {"reasoning_tokens": spent["reasoning"]},
            "total_tokens": spent["input"] + spent["output"]}


def _jsonl(records: Iterable[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(record, ensure_ascii=False).encode() + b"\n" for record in records)


class BatchStore:
    def __init__(self, db: Database, files: FileStore) -> None:
        self._db = db
        self.files = files

    # ---- the API's side -------------------------------------------------------------------------------
    def create(self, key_id: str | None, input_file_id: str, endpoint: str, completion_window: str,
               metadata: dict[str, str] | None, output_expires_after: int = DEFAULT_EXPIRES_AFTER) -> dict[str, Any]:
        """A new batch, "validating" until a runner reads its file; its output and error files are kept for
        `output_expires_after` seconds. Raises InvalidRequestError for an endpoint, window, metadata or time to keep
        files this server does not take, FileNotFound for a file the key does not have (or no longer has), and
        InvalidRequestError for a file that is not a batch input."""
        check_expires_after(output_expires_after, "output_expires_after.seconds")
        if endpoint not in ENDPOINTS:
            raise InvalidRequestError(f"Invalid endpoint {endpoint!r}: one of {', '.join(ENDPOINTS)}.",
                                      param="endpoint")
        window = COMPLETION_WINDOWS.get(completion_window)
        if window is None:
            raise InvalidRequestError(f"Invalid completion_window {completion_window!r}: only '24h' is supported.",
                                      param="completion_window")
        metadata = checked_metadata(metadata) if metadata is not None else None
        now = utcnow()
        with self._db.session(write=True) as session:
            source = FileStore._row(session, key_id, input_file_id)
            if source.purpose != "batch":
                raise InvalidRequestError(f"File {input_file_id} has purpose {source.purpose!r}, not 'batch'.",
                                          param="input_file_id")
            row = BatchRow(id=f"batch_{secrets.token_hex(12)}", key_id=key_id, endpoint=endpoint,
                           input_file_id=input_file_id, completion_window=completion_window, status="validating",
                           metadata_=metadata, total=0, completed=0, failed=0, created_at=now,
                           expires_at=now + window, output_expires_after=output_expires_after)
            session.add(row)
            return batch_object(row)

    def get(self, key_id: str | None, batch_id: str) -> dict[str, Any]:
        with self._db.session() as session:
            return batch_object(self._row(session, key_id, batch_id))

    def list(self, key_id: str | None, limit: int = 20, after: str | None = None,
             endpoint: str | None = None, before: str | None = None) -> tuple[list[dict[str, Any]], bool]:
        """A page of the key's batches (those to `endpoint` alone, when given), newest first: the next older than
        `after` (the last id of the page before), or the next newer than `before` (the first id of the page after:
        Anthropic's `before_id`); has_more: there are more that way."""
        _check_limit(limit, 100)
        query = select(BatchRow).where(_owned_by(BatchRow.key_id, key_id))
        if endpoint is not None:
            query = query.where(BatchRow.endpoint == endpoint)
        newest_first = (BatchRow.created_at.desc(), BatchRow.id.desc())
        with self._db.session() as session:
            for anchor_id, param, newer in ((after, "after", False), (before, "before", True)):
                if anchor_id is not None:
                    anchor = session.get(BatchRow, anchor_id)
                    if anchor is None or anchor.key_id != key_id:
                        raise InvalidRequestError(f"No batch with id {anchor_id!r}.", param=param)
                    query = query.where(_beyond(BatchRow, anchor, ascending=newer))
            if before is None:
                return _page(list(session.scalars(query.order_by(*newest_first).limit(limit + 1))), limit, batch_object)
            oldest_first = (BatchRow.created_at.asc(), BatchRow.id.asc())
            rows = list(session.scalars(query.order_by(*oldest_first).limit(limit + 1)))
            return [batch_object(row) for row in reversed(rows[:limit])], len(rows) > limit

    def cancel(self, key_id: str | None, batch_id: str) -> dict[str, Any]:
        """Ask for the batch to stop: "cancelling" until its runner has stopped its requests and written what it
        has, then "cancelled". Cancelling a cancelling batch is harmless; BatchNotCancellable once it has ended."""
        with self._db.session(write=True) as session:
            row = self._row(session, key_id, batch_id)
            if row.status == "cancelling":
                return batch_object(row)
            if row.status not in UNFINISHED:
                raise BatchNotCancellable(f"Batch {batch_id} is {row.status}: it can no longer be cancelled.")
            row.status, row.cancelling_at = "cancelling", utcnow()
            return batch_object(row)

    def delete(self, key_id: str | None, batch_id: str) -> None:
        """Forget an ended batch, its results and its output and error files; BatchNotEnded before it ended."""
        with self._db.session(write=True) as session:
            row = self._row(session, key_id, batch_id)
            if row.status in UNFINISHED:
                raise BatchNotEnded(f"Batch {batch_id} is {row.status}: cancel it, or wait for it to end, first.")
            session.execute(delete(BatchResultRow).where(BatchResultRow.batch_id == batch_id))
            for file_id in (row.output_file_id, row.error_file_id):
                if file_id is not None:
                    session.execute(delete(FileRow).where(FileRow.id == file_id))
            session.delete(row)

    # ---- the runner's side ----------------------------------------------------------------------------
    def claim(self, runner: str, lease: timedelta) -> ClaimedBatch | None:
        """Take the lease on the oldest unfinished batch that nobody holds (or whose holder let it run out)."""
        now = utcnow()
        free = (BatchRow.lease_until.is_(None)) | (BatchRow.lease_until < now)
        with self._db.session(write=True) as session:
            candidates = session.scalars(select(BatchRow.id).where(BatchRow.status.in_(UNFINISHED), free)
                                         .order_by(BatchRow.created_at, BatchRow.id).limit(8)).all()
            for batch_id in candidates:
                taken = session.execute(update(BatchRow).where(BatchRow.id == batch_id, free).values(
                    runner=runner, lease_until=now + lease)).rowcount
                if taken == 1:
                    row = session.get(BatchRow, batch_id)
                    return ClaimedBatch(row.id, row.key_id, row.endpoint, row.input_file_id, row.status,
                                        row.expires_at)
        return None

    def renew(self, batch_id: str, runner: str, lease: timedelta) -> BatchStatus | None:
        """Extend this runner's lease; the batch's status now (a cancel shows here), or None if the lease was lost."""
        with self._db.session(write=True) as session:
            row = session.get(BatchRow, batch_id)
            if row is None or row.runner != runner:
                return None
            row.lease_until = utcnow() + lease
            return row.status  # type: ignore[return-value]

    def release(self, batch_id: str, runner: str) -> None:
        """Give the lease back (this server stops), so that another may take the batch over at once."""
        with self._db.session(write=True) as session:
            session.execute(update(BatchRow).where(BatchRow.id == batch_id, BatchRow.runner == runner)
                            .values(runner=None, lease_until=None))

    def input_of(self, batch: ClaimedBatch) -> bytes | None:
        """The batch's input file (None once deleted: only possible after the batch ended)."""
        with self._db.session() as session:
            row = session.get(FileRow, batch.input_file_id)
            return row.content if row is not None else None

    def fail(self, batch_id: str, runner: str, errors: list[dict[str, Any]]) -> None:
        """The input file is not a valid batch: "failed", with what is wrong with it."""
        with self._db.session(write=True) as session:
            row = self._held(session, batch_id, runner)
            if row is not None:
                row.status, row.errors, row.failed_at = "failed", errors, utcnow()
                row.runner = row.lease_until = None

    def start(self, batch_id: str, runner: str, total: int) -> None:
        with self._db.session(write=True) as session:
            row = self._held(session, batch_id, runner)
            if row is not None and row.status == "validating":
                row.status, row.total, row.in_progress_at = "in_progress", total, utcnow()

    def status_of(self, batch_id: str) -> BatchStatus | None:
        with self._db.session() as session:
            return session.scalar(select(BatchRow.status).where(BatchRow.id == batch_id))

    def answered_lines(self, batch_id: str) -> set[int]:
        """The lines of the requests that have a result already (from an earlier run of the batch)."""
        with self._db.session() as session:
            return set(session.scalars(select(BatchResultRow.line).where(BatchResultRow.batch_id == batch_id)))

    def save_result(self, batch_id: str, line: int, succeeded: bool, record: dict[str, Any]) -> None:
        """Keep one request's result and count it. A line answered twice (two runners, one of them past its lease)
        keeps its first answer."""
        with self._db.session(write=True) as session:
            if session.get(BatchResultRow, (batch_id, line)) is not None:
                return
            session.add(BatchResultRow(batch_id=batch_id, line=line, succeeded=succeeded, record=record))
            counter = BatchRow.completed if succeeded else BatchRow.failed
            session.execute(update(BatchRow).where(BatchRow.id == batch_id).values({counter: counter + 1}))

    def finish(self, batch_id: str, runner: str, status: Literal["completed", "cancelled", "expired", "failed"],
               unanswered: list[dict[str, Any]]) -> None:
        """End the batch: its output file (the answered requests, in input order), its error file (the failed
        ones, and `unanswered`: those that never ran), and its final status ("failed": it could not run on, and
        the first unanswered request's error says why)."""
        with self._db.session(write=True) as session:
            row = self._held(session, batch_id, runner)
            if row is None:
                return
            now = utcnow()
            if row.status == "cancelling":  # a cancel that came while the last requests ran
                status = "cancelled"
            row.status, row.finalizing_at = "finalizing", now
            results = session.scalars(select(BatchResultRow).where(BatchResultRow.batch_id == batch_id)
                                      .order_by(BatchResultRow.line)).all()
            succeeded = [result.record for result in results if result.succeeded]
            failed = [result.record for result in results if not result.succeeded] + unanswered
            row.usage = _usage(succeeded)
            if succeeded:
                row.output_file_id = self._add_output(session, row, "output", succeeded)
            if failed:
                row.error_file_id = self._add_output(session, row, "error", failed)
            row.failed += len(unanswered)
            if status == "failed" and unanswered:
                row.errors = [{**unanswered[0]["error"], "param": None, "line": None}]
            row.status = status
            setattr(row, f"{status}_at", now)
            row.runner = row.lease_until = None

    def _add_output(self, session: Session, batch: BatchRow, kind: str, records: list[dict[str, Any]]) -> str:
        content, now = _jsonl(records), utcnow()
        file = FileRow(id=f"file-{secrets.token_hex(12)}", key_id=batch.key_id, filename=f"{batch.id}_{kind}.jsonl",
                       purpose=OUTPUT_PURPOSE, bytes=len(content), content=content, created_at=now,
                       expires_at=_expiry(now, batch.output_expires_after))
        session.add(file)
        return file.id

    @staticmethod
    def _held(session: Session, batch_id: str, runner: str) -> BatchRow | None:
        row = session.get(BatchRow, batch_id)
        return row if row is not None and row.runner == runner else None

    @staticmethod
    def _row(session: Session, key_id: str | None, batch_id: str) -> BatchRow:
        return _owned_row(session, BatchRow, key_id, batch_id, BatchNotFound)

