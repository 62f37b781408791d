"""Chat completions made with `store: true`, kept for the key that asked for them (OpenAI's stored chat
completions): listed a page at a time, by model and by metadata; read back with the messages their request sent;
their metadata replaced; deleted on request, and purged when older than the retention period.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import and_, delete, or_, select
from sqlalchemy.orm import Session

from llmserve.errors import InvalidRequestError, LLMServeError
from llmserve.platform.paging import check_limit, page_after
from llmserve.store.db import Database
from llmserve.store.schema import ChatCompletionRow, utcnow

Order = Literal["asc", "desc"]


class CompletionNotFound(LLMServeError):
    """No such stored completion for this key: unknown, deleted, purged, or another key's (all look the same)."""

    def __init__(self, completion_id: str) -> None:
        super().__init__(f"chat completion {completion_id!r} not found")
        self.completion_id = completion_id


def stored_messages(completion_id: str, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's messages as listed back: each with an id, its text as `content` and, when it was sent as
    parts, those parts as `content_parts` (OpenAI's shape of a stored message)."""
    stored = []
    for i, message in enumerate(messages):
        content = message.get("content")
        parts = content if isinstance(content, list) else None
        if parts is not None:
            texts = [part["text"] for part in parts if part.get("type") == "text"]
            content = "".join(texts) if texts else None
        stored.append({"id": f"{completion_id}-{i}", **message, "content": content, "content_parts": parts})
    return stored


def _owned_by(key_id: str | None) -> Any:
    # Local mode (no keys) owns exactly the completions stored without a key.
    return ChatCompletionRow.key_id.is_(None) if key_id is None else ChatCompletionRow.key_id == key_id


class StoredCompletions:
    """Stored chat completions in the database. Every method is one short transaction; safe from any thread.
    `key_id` is the caller's key (None in local mode); another key's completion raises CompletionNotFound."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def save(self, key_id: str | None, completion: dict[str, Any], messages: list[dict[str, Any]],
             metadata: Mapping[str, str]) -> None:
        """Keep `completion` (as answered) with its request's messages (as `stored_messages` lists them)."""
        row = ChatCompletionRow(id=completion["id"], key_id=key_id, model=completion["model"], created_at=utcnow(),
                                completion=completion, messages=messages, tags=dict(metadata))
        with self._db.session(write=True) as session:
            session.add(row)

    def get(self, key_id: str | None, completion_id: str) -> dict[str, Any]:
        """The completion as answered, with its current metadata."""
        with self._db.session() as session:
            return _as_listed(self._row(session, key_id, completion_id))

    def list(self, key_id: str | None, model: str | None = None, metadata: Mapping[str, str] | None = None,
             limit: int = 20, after: str | None = None, order: Order = "asc") -> tuple[list[dict[str, Any]], bool]:
        """One page of the key's completions by creation time (oldest first unless `order` is "desc"), those of
        `model` alone and those whose metadata holds every pair of `metadata`; and whether more follow. `after`
        is the id of the last completion of the previous page. Raises InvalidRequestError for a limit outside
        1..100 or an unknown `after`."""
        check_limit(limit)
        row = ChatCompletionRow
        query = select(row).where(_owned_by(key_id))
        if model is not None:
            query = query.where(row.model == model)
        for name, value in (metadata or {}).items():
            query = query.where(row.tags[name].as_string() == value)
        ascending = order == "asc"
        ordering = (row.created_at, row.id) if ascending else (row.created_at.desc(), row.id.desc())
        query = query.order_by(*ordering).limit(limit + 1)
        with self._db.session() as session:
            if after is not None:
                cursor = session.scalars(select(row).where(row.id == after, _owned_by(key_id))).first()
                if cursor is None:
                    raise InvalidRequestError(f"No chat completion with id {after!r}.", param="after")
                query = query.where(_past(cursor, ascending))
            rows = list(session.scalars(query))
            return [_as_listed(found) for found in rows[:limit]], len(rows) > limit

    def messages(self, key_id: str | None, completion_id: str, limit: int = 20, after: str | None = None,
                 order: Order = "asc") -> tuple[list[dict[str, Any]], bool]:
        """One page of the messages `completion_id`'s request sent, and whether more follow. `after` is the id of
        the last message of the previous page."""
        check_limit(limit)
        with self._db.session() as session:
            messages = list(self._row(session, key_id, completion_id).messages)
        return page_after(messages, limit, after, order,
                          f"No message with id {after!r} in chat completion {completion_id!r}.")

    def update_metadata(self, key_id: str | None, completion_id: str, metadata: Mapping[str, str]) -> dict[str, Any]:
        """Replace the completion's metadata; the completion as it now reads."""
        with self._db.session(write=True) as session:
            row = self._row(session, key_id, completion_id)
            row.tags = dict(metadata)
            return _as_listed(row)

    def delete(self, key_id: str | None, completion_id: str) -> None:
        with self._db.session(write=True) as session:
            session.delete(self._row(session, key_id, completion_id))

    def purge(self, retention: timedelta, now: datetime | None = None) -> int:
        """Delete completions stored longer ago than `retention`; how many went."""
        cutoff = (now or utcnow()) - retention
        with self._db.session(write=True) as session:
            return session.execute(delete(ChatCompletionRow).where(ChatCompletionRow.created_at < cutoff)).rowcount

    @staticmethod
    def _row(session: Session, key_id: str | None, completion_id: str) -> ChatCompletionRow:
        row = session.scalars(select(ChatCompletionRow).where(ChatCompletionRow.id == completion_id,
                                                              _owned_by(key_id))).first()
        if row is None:
            raise CompletionNotFound(completion_id)
        return row


def _past(cursor: ChatCompletionRow, ascending: bool) -> Any:
    """Rows after `cursor` in the listing's order (by creation time, then id)."""
    row = ChatCompletionRow
    if ascending:
        return or_(row.created_at > cursor.created_at, and_(row.created_at == cursor.created_at, row.id > cursor.id))
    return or_(row.created_at < cursor.created_at, and_(row.created_at == cursor.created_at, row.id < cursor.id))


def _as_listed(row: ChatCompletionRow) -> dict[str, Any]:
    return {**row.completion, "metadata": dict(row.tags)}
