"""Responses API responses kept for the key that asked for them: GET /v1/responses/{id} reads one back, and a
request that names it as its `previous_response_id` continues its conversation.

A response is stored with the input items its own request sent; the conversation before them is its previous
response's, so a chain of N turns stores each turn once. Reading a response's context walks the chain back to
its first turn. Responses are deleted on request, and purged when older than the retention period; a response
whose chain lost a turn that way can no longer be continued (its context would silently miss a turn).

A background response is stored `queued` at once and replaced as it goes (`replace_unfinished`): only while it has
not ended, so of a cancel and the end of its run, whichever is stored first stands, whatever process made each.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import CTE, delete, literal, select, text
from sqlalchemy.orm import Session, aliased

from llmserve.errors import InvalidRequestError, LLMServeError
from llmserve.platform.paging import check_limit, page_after
from llmserve.store.db import Database
from llmserve.store.schema import ResponseRow, utcnow

# Item type -> the prefix of the ids given to input items sent without one (as OpenAI's own ids read).
_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
# The statuses of a background response that has not ended yet.
UNFINISHED = ("queued", "in_progress")


class ResponseNotFound(LLMServeError):
    """No such response for this key: unknown, deleted, purged, or another key's (all look the same: 404)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(f"response {response_id!r} not found")
        self.response_id = response_id


class ResponseChainBroken(LLMServeError):
    """A response whose conversation lost an earlier turn (deleted or purged): it cannot be continued."""

    def __init__(self, response_id: str, missing_id: str) -> None:
        super().__init__(f"response {response_id!r} continues {missing_id!r}, which is no longer stored")
        self.response_id = response_id
        self.missing_id = missing_id


def with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as stored and listed: each with its type (a message when it names none) and an id."""
    stored = []
    for item in items:
        kind = item.get("type", "message")
        stored.append({"id": f"{_ITEM_ID_PREFIXES.get(kind, 'item')}_{uuid.uuid4().hex}", **item, "type": kind})
    return stored


def _owned_by(key_id: str | None) -> Any:
    # Local mode (no keys) owns exactly the responses stored without a key.
    return ResponseRow.key_id.is_(None) if key_id is None else ResponseRow.key_id == key_id


class ResponseStore:
    """Stored responses in the database. Every method is one short transaction; safe from any thread. `key_id`
    is the caller's key (None in local mode); another key's response raises ResponseNotFound, as an unknown one."""

    def __init__(self, db: Database, max_turns: int = 10_000) -> None:
        self._db = db
        self.max_turns = max_turns  # the longest chain a request may continue

    def save(self, key_id: str | None, response: dict[str, Any], input_items: list[dict[str, Any]],
             previous_id: str | None) -> None:
        """Keep `response` (as answered, with its id, model and output) and the input items its request sent."""
        row = ResponseRow(id=response["id"], key_id=key_id, previous_id=previous_id, model=response["model"],
                          created_at=utcnow(), response=response, input_items=input_items)
        with self._db.session(write=True) as session:
            session.add(row)

    def replace_unfinished(self, key_id: str | None, response: dict[str, Any]) -> bool:
        """Replace the stored response of `response`'s id with it while the stored one's status is still queued or
        in_progress (a background response not ended); whether it did (not for one ended, deleted or unknown). The
        row is locked from the read to the write, so two replacements racing cannot both find it unfinished."""
        with self._db.session(write=True) as session:
            query = select(ResponseRow).where(ResponseRow.id == response["id"], _owned_by(key_id)).with_for_update()
            row = session.scalars(query).first()
            if row is None or row.response.get("status") not in UNFINISHED:
                return False
            row.response = response
            row.model = response["model"]
            return True

    def get(self, key_id: str | None, response_id: str) -> dict[str, Any]:
        with self._db.session() as session:
            return self._row(session, key_id, response_id).response

    def context(self, key_id: str | None, response_id: str) -> list[dict[str, Any]]:
        """The conversation a request continuing `response_id` follows, oldest first: each turn's input items,
        then its output items. Raises ResponseNotFound, ResponseChainBroken, or InvalidRequestError when the
        chain is longer than `max_turns`. One query, however long the chain."""
        with self._db.session() as session:
            turns = session.execute(select(self._chain(response_id)).order_by(text("depth"))).all()
        if not turns or turns[0].key_id != key_id:
            raise ResponseNotFound(response_id)
        if len(turns) > self.max_turns:
            raise InvalidRequestError(f"The conversation of {response_id!r} has more than {self.max_turns} turns; "
                                      "send it as input instead.", param="previous_response_id")
        for turn, earlier in zip(turns, [*turns[1:], None], strict=True):
            if turn.previous_id is None:
                break
            if earlier is None or earlier.key_id != key_id:
                raise ResponseChainBroken(response_id, turn.previous_id)
        return [item for turn in reversed(turns) for item in [*turn.input_items, *(turn.response.get("output") or ())]]

    def _chain(self, response_id: str) -> CTE:
        """`response_id` and the responses before it, newest first (`depth` 1, 2, ...), up to one past `max_turns`."""
        columns = (ResponseRow.id, ResponseRow.previous_id, ResponseRow.key_id, ResponseRow.input_items,
                   ResponseRow.response)
        chain = select(*columns, literal(1).label("depth")).where(ResponseRow.id == response_id).cte(
            "chain", recursive=True)
        earlier = aliased(ResponseRow)
        return chain.union_all(
            select(earlier.id, earlier.previous_id, earlier.key_id, earlier.input_items, earlier.response,
                   chain.c.depth + 1)
            .where(earlier.id == chain.c.previous_id, chain.c.depth <= self.max_turns)
        )

    def input_items(self, key_id: str | None, response_id: str, limit: int = 20, after: str | None = None,
                    order: Literal["asc", "desc"] = "desc") -> tuple[list[dict[str, Any]], bool]:
        """One page of the input items `response_id`'s request sent, and whether more follow. `after` is the id
        of the last item of the previous page. Raises InvalidRequestError for a limit outside 1..100 or an
        unknown `after`."""
        check_limit(limit)
        with self._db.session() as session:
            items = list(self._row(session, key_id, response_id).input_items)
        return page_after(items, limit, after, order, f"No input item with id {after!r} in response {response_id!r}.")

    def delete(self, key_id: str | None, response_id: str) -> None:
        with self._db.session(write=True) as session:
            session.delete(self._row(session, key_id, response_id))

    def purge(self, retention: timedelta, now: datetime | None = None) -> int:
        """Delete responses stored longer ago than `retention`; how many went."""
        cutoff = (now or utcnow()) - retention
        with self._db.session(write=True) as session:
            return session.execute(delete(ResponseRow).where(ResponseRow.created_at < cutoff)).rowcount

    @staticmethod
    def _row(session: Session, key_id: str | None, response_id: str) -> ResponseRow:
        row = session.scalars(select(ResponseRow).where(ResponseRow.id == response_id, _owned_by(key_id))).first()
        if row is None:
            raise ResponseNotFound(response_id)
        return row
