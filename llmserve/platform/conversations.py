"""Conversations owned by an API key, stored as a tree of messages.

Each message points at its parent, and the conversation at its head (the newest message of the
active branch). Appending with an earlier message as the parent, to regenerate a reply or edit a
turn, starts a new branch and leaves the old one in place. Deleting one message takes it out of
every branch it is on: its children move up to its parent. Deleting a conversation is soft: it is
hidden at once and `purge()` removes it for good after the retention period. A conversation carries
OpenAI's metadata (up to 16 string pairs).

What a conversation may hold is bounded (ConversationLimits): the bytes of one message, the messages
added at once, and the messages of one conversation (every branch counted).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import Enum
from typing import Any, Literal

from sqlalchemy import CTE, and_, delete, func, literal, or_, select, update
from sqlalchemy.orm import Session, aliased

from llmserve.errors import InvalidRequestError, LLMServeError
from llmserve.platform.metadata import checked_metadata
from llmserve.platform.paging import check_limit
from llmserve.store.db import Database
from llmserve.store.schema import MODEL_NAME_LENGTH, NAME_LENGTH, ConversationRow, MessageRow, utcnow

ROLES = ("system", "developer", "user", "assistant", "tool")
TOOL_CALL_FIELDS = ("call_id", "name", "arguments")
MAX_CALL_ID_LENGTH = 255  # MessageRow.tool_call_id's
DERIVED_TITLE_LENGTH = 60
ORDERS = ("asc", "desc")
Order = Literal["asc", "desc"]


class Unchanged(Enum):
    """What `ConversationStore.update` leaves as it is (a field not given, as opposed to one given as None)."""

    UNCHANGED = "unchanged"


UNCHANGED = Unchanged.UNCHANGED


class ConversationNotFound(LLMServeError):
    """No such conversation for this key: unknown, deleted, or another key's (all look the same: 404)."""

    def __init__(self, conversation_id: str) -> None:
        super().__init__(f"conversation {conversation_id!r} not found")
        self.conversation_id = conversation_id


class MessageNotFound(LLMServeError):
    """No such message in the conversation (404 over HTTP)."""

    def __init__(self, message_id: str) -> None:
        super().__init__(f"message {message_id!r} not found")
        self.message_id = message_id


class ConversationLimitExceeded(LLMServeError):
    """A message too large, or too many messages at once or in one conversation (413 over HTTP)."""

    def __init__(self, message: str, param: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(frozen=True)
class ConversationLimits:
    """What a conversation may hold. The defaults keep one page of messages, and one conversation's
    history, small enough to load and template in a request."""

    max_message_bytes: int = 1 << 20  # UTF-8 bytes of one message's content (1 MiB)
    max_image_bytes: int = 64 << 20  # of one message's image URLs (data: URLs hold the images: 64 MiB)
    max_messages_per_request: int = 100  # added by one call: a create, or one chat turn's messages
    max_messages: int = 10_000  # in one conversation, every branch counted

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_image_bytes", "max_messages_per_request", "max_messages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    def check(self, contents: Sequence[str], existing: int = 0, images: Sequence[Sequence[str]] = ()) -> None:
        """Raise ConversationLimitExceeded unless `contents` (with their `images`' URLs, where given) may join a
        conversation of `existing` messages."""
        if len(contents) > self.max_messages_per_request:
            raise ConversationLimitExceeded(
                f"At most {self.max_messages_per_request} messages can be added at once; got {len(contents)}.",
                param="messages", code="too_many_messages",
            )
        for i, content in enumerate(contents):
            size = len(content.encode("utf-8", "surrogatepass"))
            if size > self.max_message_bytes:
                raise ConversationLimitExceeded(
                    f"A stored message may have at most {self.max_message_bytes} bytes of content; "
                    f"messages[{i}] has {size}.",
                    param=f"messages[{i}].content", code="message_too_large",
                )
        for i, urls in enumerate(images):
            size = sum(len(url) for url in urls)
            if size > self.max_image_bytes:
                raise ConversationLimitExceeded(
                    f"A stored message may have at most {self.max_image_bytes} bytes of images; messages[{i}] has "
                    f"{size}.", param=f"messages[{i}].content", code="message_too_large",
                )
        if existing + len(contents) > self.max_messages:
            raise ConversationLimitExceeded(
                f"A conversation holds at most {self.max_messages} messages; it has {existing} and "
                f"{len(contents)} more were to be added.",
                param="messages", code="conversation_too_long",
            )


@dataclass(frozen=True)
class BranchTotals:
    """The active branch's size: its messages and their stored token counts."""

    messages: int
    tokens: int


@dataclass(frozen=True)
class Message:
    id: str
    conversation_id: str
    parent_id: str | None
    role: str
    content: str
    token_count: int | None
    created_at: datetime
    parts: list[dict[str, Any]] | None = None  # a message with images: its content parts (`MessageRow.parts`)
    tool_call: dict[str, str] | None = None  # an assistant's call of a tool: {"call_id", "name", "arguments"}
    tool_call_id: str | None = None  # a tool's output: the id of the call it answers
    reasoning: dict[str, Any] | None = None  # an assistant's reasoning: {"summary", "encrypted_content"?}

    @property
    def images(self) -> list[str]:
        """The URLs of its images, in order."""
        return part_image_urls(self.parts or ())

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "conversation.message",
            "parent_id": self.parent_id,
            "role": self.role,
            "content": self.content,
            "images": self.images,
            "tool_call": self.tool_call,
            "tool_call_id": self.tool_call_id,
            "reasoning": self.reasoning,
            "token_count": self.token_count,
            "created_at": int(self.created_at.timestamp()),
        }


@dataclass(frozen=True)
class Conversation:
    id: str
    key_id: str | None
    title: str | None
    model: str | None
    created_at: datetime
    updated_at: datetime
    head_message_id: str | None
    metadata: dict[str, str] = field(default_factory=dict)
    messages: tuple[Message, ...] = ()  # the active branch, oldest first; empty in listings

    def as_dict(self, with_messages: bool = True) -> dict[str, Any]:
        data: dict[str, Any] = {
            "id": self.id,
            "object": "conversation",
            "title": self.title,
            "model": self.model,
            "metadata": dict(self.metadata),
            "created_at": int(self.created_at.timestamp()),
            "updated_at": int(self.updated_at.timestamp()),
        }
        if with_messages:
            data["messages"] = [message.as_dict() for message in self.messages]
        return data


def _to_message(row: MessageRow) -> Message:
    return Message(
        id=row.id, conversation_id=row.conversation_id, parent_id=row.parent_id, role=row.role,
        content=row.content, token_count=row.token_count, created_at=row.created_at, parts=row.parts,
        tool_call=row.tool_call, tool_call_id=row.tool_call_id, reasoning=row.reasoning,
    )


def _to_conversation(row: ConversationRow, messages: Iterable[MessageRow] = ()) -> Conversation:
    return Conversation(
        id=row.id, key_id=row.key_id, title=row.title, model=row.model, created_at=row.created_at,
        updated_at=row.updated_at, head_message_id=row.head_message_id, metadata=dict(row.tags),
        messages=tuple(_to_message(m) for m in messages),
    )


def derive_title(content: str) -> str | None:
    """The first ~60 characters of a message, on one line."""
    text = " ".join(content.split())
    if len(text) <= DERIVED_TITLE_LENGTH:
        return text or None
    return text[: DERIVED_TITLE_LENGTH - 1].rstrip() + "…"


def _checked_title(title: str | None) -> str | None:
    if title is None:
        return None
    if not isinstance(title, str) or len(title) > NAME_LENGTH:
        raise ValueError(f"title must be a string of at most {NAME_LENGTH} characters")
    return title.strip() or None


def _checked_model(model: str | None) -> str | None:
    if model is not None and (not isinstance(model, str) or len(model) > MODEL_NAME_LENGTH):
        raise ValueError(f"model must be a string of at most {MODEL_NAME_LENGTH} characters")
    return model


def part_image_urls(parts: Iterable[Mapping[str, Any]]) -> list[str]:
    """The image URLs of content parts (OpenAI's image_url parts), in order."""
    return [part["image_url"]["url"] for part in parts if part.get("type") == "image_url"]


def _check_message(turn: Mapping[str, Any]) -> None:
    role, content, token_count = turn.get("role"), turn.get("content"), turn.get("token_count")
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}; got {role!r}")
    if not isinstance(content, str):
        raise ValueError("message content must be a string")
    if token_count is not None and (isinstance(token_count, bool) or not isinstance(token_count, int) or token_count < 0):
        raise ValueError(f"token_count must be a non-negative integer, got {token_count!r}")
    if turn.get("parts") is not None and role != "user":
        raise ValueError("only user messages hold images")
    _check_tool_fields(role, content, turn.get("tool_call"), turn.get("tool_call_id"))
    if turn.get("reasoning") is not None:
        _check_reasoning(role, turn["reasoning"], turn.get("tool_call"))


def _check_tool_fields(role: object, content: str, tool_call: object, tool_call_id: object) -> None:
    """A call is an assistant's, without text of its own; an output is a tool message's, and names its call."""
    if tool_call is not None:
        if role != "assistant" or content:
            raise ValueError("a tool call is an assistant message without content")
        if not isinstance(tool_call, dict) or set(tool_call) != set(TOOL_CALL_FIELDS) or not all(
                isinstance(tool_call[name], str) for name in TOOL_CALL_FIELDS):
            raise ValueError(f"a tool call has string {', '.join(TOOL_CALL_FIELDS)}; got {tool_call!r}")
        if not 0 < len(tool_call["call_id"]) <= MAX_CALL_ID_LENGTH:
            raise ValueError(f"a call_id has 1 to {MAX_CALL_ID_LENGTH} characters")
    if (role == "tool") != (tool_call_id is not None):
        raise ValueError("a tool message, and only one, names the call it answers (tool_call_id)")
    if tool_call_id is not None and not (isinstance(tool_call_id, str) and 0 < len(tool_call_id) <= MAX_CALL_ID_LENGTH):
        raise ValueError(f"a tool_call_id is a string of 1 to {MAX_CALL_ID_LENGTH} characters")


def _check_reasoning(role: object, reasoning: object, tool_call: object) -> None:
    """Reasoning is an assistant's message of its own, with its summary's text parts and what the client
    encrypted (or encoded) of it."""
    if role != "assistant" or tool_call is not None:
        raise ValueError("reasoning is an assistant message of its own")
    if not isinstance(reasoning, dict) or not set(reasoning) <= {"summary", "encrypted_content"}:
        raise ValueError(f"reasoning has a summary and an encrypted_content; got {reasoning!r}")
    summary = reasoning.get("summary")
    if not isinstance(summary, list) or not all(
            isinstance(part, dict) and part.get("type") == "summary_text" and isinstance(part.get("text"), str)
            and len(part) == 2 for part in summary):
        raise ValueError("a reasoning summary is a list of summary_text parts")
    if not isinstance(reasoning.get("encrypted_content", ""), str):
        raise ValueError("encrypted_content is a string")


def _checked_turns(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages to store ({"role", "content", "token_count"?, "parts"?, "tool_call"?, "tool_call_id"?}),
    checked."""
    turns = [dict(m) for m in messages]
    for turn in turns:
        _check_message(turn)
    return turns


def stored_size(turn: Mapping[str, Any]) -> str:
    """What of a message the size limit counts: its text, a tool call's name and arguments, or reasoning's text,
    summary and encrypted content."""
    call, reasoning = turn.get("tool_call"), turn.get("reasoning")
    if call:
        return call["name"] + call["arguments"]
    if reasoning:
        summary = "".join(part["text"] for part in reasoning["summary"])
        return turn["content"] + summary + reasoning.get("encrypted_content", "")
    return turn["content"]


def _first_user_title(turns: Iterable[Mapping[str, Any]]) -> str | None:
    """An untitled conversation's title: from its first user message."""
    return next((derive_title(turn["content"]) for turn in turns if turn["role"] == "user"), None)


def _message_rows(
    conversation_id: str, parent_id: str | None, turns: Iterable[Mapping[str, Any]], now: datetime
) -> list[MessageRow]:
    """The rows of `turns`, chained after `parent_id`, each after the one before: a microsecond later, so that
    listings ordered by time keep the order they were added in."""
    rows: list[MessageRow] = []
    for i, turn in enumerate(turns):
        rows.append(MessageRow(
            id=_new_id(_id_prefix(turn)), conversation_id=conversation_id,
            parent_id=rows[-1].id if rows else parent_id, role=turn["role"], content=turn["content"],
            parts=turn.get("parts"), tool_call=turn.get("tool_call"), tool_call_id=turn.get("tool_call_id"),
            reasoning=turn.get("reasoning"),
            token_count=turn.get("token_count"), created_at=now + timedelta(microseconds=i),
        ))
    return rows


def _id_prefix(turn: Mapping[str, Any]) -> str:
    """A message's id prefix, as OpenAI's item ids read: a message, a function call, its output, or reasoning."""
    if turn.get("reasoning") is not None:
        return "rs"
    return "fc" if turn.get("tool_call") else "fco" if turn["role"] == "tool" else "msg"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _owned_by(key_id: str | None) -> Any:
    # Local mode (no keys) owns exactly the conversations created without a key.
    return ConversationRow.key_id.is_(None) if key_id is None else ConversationRow.key_id == key_id


class ConversationStore:
    """Conversations and messages in the database. Every method is one short transaction; safe
    from any thread. `key_id` is the caller's key (None in local mode); other keys' conversations
    raise ConversationNotFound, exactly like unknown or deleted ones."""

    def __init__(self, db: Database, limits: ConversationLimits | None = None) -> None:
        self._db = db
        self.limits = limits or ConversationLimits()

    def create(
        self,
        key_id: str | None,
        title: str | None = None,
        model: str | None = None,
        messages: Iterable[Mapping[str, Any]] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> Conversation:
        """Create a conversation, optionally with messages ({"role", "content", "token_count"?, "parts"?: a
        user message's content parts, where it holds images; "tool_call"?: an assistant's call of a tool, as
        {"call_id", "name", "arguments"}, without content; "tool_call_id"?: the call a tool message answers}) as
        its first turns, in order. Without a
        title, the first user message provides one."""
        turns = _checked_turns(messages or ())
        self._check_limits(turns)
        title = _checked_title(title)
        if title is None:
            title = _first_user_title(turns)
        now = utcnow()
        conversation = ConversationRow(
            id=_new_id("conv"), key_id=key_id, title=title, model=_checked_model(model),
            tags=checked_metadata(metadata), created_at=now, updated_at=now,
        )
        rows = _message_rows(conversation.id, None, turns, now)
        conversation.head_message_id = rows[-1].id if rows else None
        with self._db.session(write=True) as session:
            session.add(conversation)
            session.flush()  # the conversation row first: the messages refer to it
            session.add_all(rows)
        return _to_conversation(conversation, rows)

    def list(self, key_id: str | None, limit: int = 20, after: str | None = None) -> tuple[list[Conversation], bool]:
        """One page of the key's conversations, newest first, without messages, and whether more follow.

        `after` is the id of the last conversation of the previous page. Raises InvalidRequestError
        (a ValueError) for a limit outside 1..100 or an unknown `after`.
        """
        check_limit(limit)
        conv = ConversationRow
        query = (
            select(conv)
            .where(_owned_by(key_id), conv.deleted_at.is_(None))
            .order_by(conv.created_at.desc(), conv.id.desc())
            .limit(limit + 1)
        )
        with self._db.session() as session:
            if after is not None:
                cursor = session.scalars(select(conv).where(conv.id == after, _owned_by(key_id))).first()
                if cursor is None:
                    raise _unknown_cursor("after", after)
                query = query.where(or_(
                    conv.created_at < cursor.created_at,
                    and_(conv.created_at == cursor.created_at, conv.id < cursor.id),
                ))
            rows = list(session.scalars(query))
        return [_to_conversation(row) for row in rows[:limit]], len(rows) > limit

    def get(self, key_id: str | None, conversation_id: str) -> Conversation:
        """The conversation with its active branch of messages, oldest first."""
        with self._db.session() as session:
            conversation = self._owned(session, key_id, conversation_id)
            return _to_conversation(conversation, self._branch(session, conversation.head_message_id))

    def summary(self, key_id: str | None, conversation_id: str) -> tuple[Conversation, BranchTotals]:
        """The conversation without its messages, and the size of its active branch."""
        with self._db.session() as session:
            conversation = self._owned(session, key_id, conversation_id)
            totals = BranchTotals(0, 0)
            if conversation.head_message_id is not None:
                path = self._path(conversation.head_message_id)
                count, tokens = session.execute(
                    select(func.count(), func.coalesce(func.sum(MessageRow.token_count), 0))
                    .select_from(MessageRow)
                    .join(path, MessageRow.id == path.c.id)
                ).one()
                totals = BranchTotals(count, tokens)
            return _to_conversation(conversation), totals

    def messages(
        self,
        key_id: str | None,
        conversation_id: str,
        limit: int = 20,
        order: Order = "desc",
        after: str | None = None,
        before: str | None = None,
    ) -> tuple[list[Message], bool]:
        """One page of the active branch's messages, and whether more follow in that direction.

        `order` "desc" lists newest first. `after` (or `before`) is a message id of the branch: the
        page holds the messages right after (or right before) it in the listing's order. Raises
        ConversationNotFound, or InvalidRequestError for a bad limit or order, or a cursor that is
        not a message of the active branch.
        """
        check_limit(limit)
        if order not in ORDERS:
            raise InvalidRequestError(f"order must be 'asc' or 'desc', got {order!r}", param="order")
        if after is not None and before is not None:
            raise InvalidRequestError("Give either after or before, not both.", param="before")
        cursor_param, cursor = ("before", before) if before is not None else ("after", after)
        with self._db.session() as session:
            head_id = self._owned(session, key_id, conversation_id).head_message_id
            path = self._path(head_id or "")  # no head, no path: an empty page
            # A message's place in the listing: its distance from the head, negated for oldest first.
            place = path.c.depth if order == "desc" else -path.c.depth
            query = select(MessageRow).join(path, MessageRow.id == path.c.id).limit(limit + 1)
            if cursor is not None:
                depth = session.scalar(select(path.c.depth).where(path.c.id == cursor))
                if depth is None:
                    raise _unknown_cursor(cursor_param, cursor)
                cursor_place = depth if order == "desc" else -depth
                query = query.where(place < cursor_place if before is not None else place > cursor_place)
            # A page before the cursor is the nearest messages to it: fetched backwards, then turned round.
            rows = list(session.scalars(query.order_by(place.desc() if before is not None else place)))
        page = rows[:limit]
        if before is not None:
            page.reverse()
        return [_to_message(row) for row in page], len(rows) > limit

    def tree(self, key_id: str | None, conversation_id: str) -> tuple[Conversation, list[Message]]:
        """The conversation (its head marks the active branch) and every message of every branch, oldest
        first: what a client needs to show the branches and move between them. Bounded by the limit on
        a conversation's messages."""
        with self._db.session() as session:
            conversation = self._owned(session, key_id, conversation_id)
            rows = session.scalars(
                select(MessageRow)
                .where(MessageRow.conversation_id == conversation.id)
                .order_by(MessageRow.created_at, MessageRow.id)
            )
            return _to_conversation(conversation), [_to_message(row) for row in rows]

    def update(
        self,
        key_id: str | None,
        conversation_id: str,
        title: str | None | Unchanged = UNCHANGED,
        metadata: Mapping[str, str] | None | Unchanged = UNCHANGED,
    ) -> Conversation:
        """Replace what is given: the title (None or blank: untitled), the metadata (None: none). With
        neither, nothing changes."""
        with self._db.session(write=True) as session:
            conversation = self._owned(session, key_id, conversation_id, lock=True)
            if title is not UNCHANGED:
                conversation.title = _checked_title(title)
            if metadata is not UNCHANGED:
                conversation.tags = checked_metadata(metadata)
            if title is not UNCHANGED or metadata is not UNCHANGED:
                conversation.updated_at = utcnow()
            return _to_conversation(conversation)

    def message(self, key_id: str | None, conversation_id: str, message_id: str) -> Message:
        """One message of the conversation, on whichever branch. Raises ConversationNotFound or MessageNotFound."""
        with self._db.session() as session:
            conversation = self._owned(session, key_id, conversation_id)
            return _to_message(self._message_in(session, conversation, message_id))

    def message_count(self, key_id: str | None, conversation_id: str) -> int:
        """How many messages the conversation holds, every branch counted (what its limit counts)."""
        with self._db.session() as session:
            return self._message_count(session, self._owned(session, key_id, conversation_id).id)

    def history(self, key_id: str | None, conversation_id: str, up_to: str | None = None) -> list[Message]:
        """The active branch's messages, oldest first: the context for the next turn. With `up_to`, the
        path from the root to that message instead (to branch from it); ValueError if it is not in
        this conversation."""
        if up_to is None:
            return list(self.get(key_id, conversation_id).messages)
        with self._db.session() as session:
            conversation = self._owned(session, key_id, conversation_id)
            parent = session.get(MessageRow, up_to)
            if parent is None or parent.conversation_id != conversation.id:
                raise ValueError(f"message {up_to!r} is not in conversation {conversation_id!r}")
            return [_to_message(row) for row in self._branch(session, up_to)]

    def append(
        self,
        key_id: str | None,
        conversation_id: str,
        role: str,
        content: str,
        token_count: int | None = None,
        parent_id: str | None = None,
        parts: list[dict[str, Any]] | None = None,
    ) -> Message:
        """Add a message after `parent_id` (default: the head) and make it the head; `parts`: a user message's
        content parts as sent, where it holds images (`content` is its text).

        An earlier parent branches: the path from the root to the new message becomes the active
        branch. Raises ConversationNotFound, ConversationLimitExceeded, or ValueError for bad input
        or a parent from elsewhere.
        """
        turn = {"role": role, "content": content, "token_count": token_count, "parts": parts}
        return self.extend(key_id, conversation_id, [turn], parent_id)[0]

    def extend(
        self,
        key_id: str | None,
        conversation_id: str,
        messages: Iterable[Mapping[str, Any]],
        parent_id: str | None = None,
    ) -> list[Message]:
        """Add messages (as `create` takes them), in order, after `parent_id` (default: the head), and make the
        last one the head: `append` for several at once, all or none of them (the limits count them together)."""
        turns = _checked_turns(messages)
        with self._db.session(write=True) as session:
            # Locked so concurrent appends to one conversation chain up instead of forking (and
            # cannot both take the last place under the message limit).
            conversation = self._owned(session, key_id, conversation_id, lock=True)
            self._check_limits(turns, existing=self._message_count(session, conversation.id))
            if parent_id is None:
                parent_id = conversation.head_message_id
            else:
                parent = session.get(MessageRow, parent_id)
                if parent is None or parent.conversation_id != conversation.id:
                    raise ValueError(f"message {parent_id!r} is not in conversation {conversation_id!r}")
            now = utcnow()
            rows = _message_rows(conversation.id, parent_id, turns, now)
            session.add_all(rows)
            if rows:
                conversation.head_message_id = rows[-1].id
                conversation.updated_at = now
            if conversation.title is None:
                conversation.title = _first_user_title(turns)
        return [_to_message(row) for row in rows]

    def delete_message(self, key_id: str | None, conversation_id: str, message_id: str) -> Conversation:
        """Remove one message from every branch it is on: its children (of every branch) follow its parent
        instead, and the head, when it was the head, moves to its parent. Raises ConversationNotFound or
        MessageNotFound."""
        with self._db.session(write=True) as session:
            conversation = self._owned(session, key_id, conversation_id, lock=True)
            message = self._message_in(session, conversation, message_id)
            session.execute(
                update(MessageRow).where(MessageRow.parent_id == message.id).values(parent_id=message.parent_id)
            )
            if conversation.head_message_id == message.id:
                conversation.head_message_id = message.parent_id
            session.delete(message)
            conversation.updated_at = utcnow()
            return _to_conversation(conversation)

    def delete(self, key_id: str | None, conversation_id: str) -> None:
        """Hide the conversation at once; `purge()` removes it after the retention period."""
        with self._db.session(write=True) as session:
            self._owned(session, key_id, conversation_id, lock=True).deleted_at = utcnow()

    def purge(self, older_than: timedelta, now: datetime | None = None) -> int:
        """Remove, with their messages, conversations deleted more than `older_than` ago. Returns how many."""
        cutoff = (now or utcnow()) - older_than
        conv = ConversationRow
        expired = select(conv.id).where(conv.deleted_at.is_not(None), conv.deleted_at < cutoff)
        with self._db.session(write=True) as session:
            ids = list(session.scalars(expired))
            if not ids:
                return 0
            messages = MessageRow.conversation_id.in_(ids)
            # Unchained first: deleting a chained message would cascade to its child, and that to its own, one
            # nested trigger a message (SQLite stops at 1,000 levels).
            session.execute(update(MessageRow).where(messages).values(parent_id=None))
            session.execute(delete(MessageRow).where(messages))
            session.execute(delete(conv).where(conv.id.in_(ids)))
        return len(ids)

    @staticmethod
    def _owned(session: Session, key_id: str | None, conversation_id: str, lock: bool = False) -> ConversationRow:
        query = select(ConversationRow).where(
            ConversationRow.id == conversation_id, _owned_by(key_id), ConversationRow.deleted_at.is_(None)
        )
        if lock:
            query = query.with_for_update()
        conversation = session.scalars(query).first()
        if conversation is None:
            raise ConversationNotFound(conversation_id)
        return conversation

    @staticmethod
    def _message_in(session: Session, conversation: ConversationRow, message_id: str) -> MessageRow:
        message = session.get(MessageRow, message_id)
        if message is None or message.conversation_id != conversation.id:
            raise MessageNotFound(message_id)
        return message

    def _check_limits(self, turns: Sequence[Mapping[str, Any]], existing: int = 0) -> None:
        self.limits.check([stored_size(turn) for turn in turns], existing=existing,
                          images=[part_image_urls(turn.get("parts") or ()) for turn in turns])

    @staticmethod
    def _message_count(session: Session, conversation_id: str) -> int:
        query = select(func.count()).select_from(MessageRow).where(MessageRow.conversation_id == conversation_id)
        return session.scalar(query) or 0

    @staticmethod
    def _path(head_id: str) -> CTE:
        """The ids from `head_id` up to the root, each with its `depth` (0 for the head)."""
        path = (
            select(MessageRow.id, MessageRow.parent_id, literal(0).label("depth"))
            .where(MessageRow.id == head_id)
            .cte("path", recursive=True)
        )
        parent = aliased(MessageRow)
        return path.union_all(
            select(parent.id, parent.parent_id, path.c.depth + 1).where(parent.id == path.c.parent_id)
        )

    @classmethod
    def _branch(cls, session: Session, head_id: str | None) -> list[MessageRow]:
        """The messages from the root to `head_id`, oldest first, in one recursive query."""
        if head_id is None:
            return []
        path = cls._path(head_id)
        query = select(MessageRow).join(path, MessageRow.id == path.c.id).order_by(path.c.depth.desc())
        return list(session.scalars(query))


def _unknown_cursor(param: str, cursor: str | None) -> InvalidRequestError:
    return InvalidRequestError(f"unknown pagination cursor {cursor!r}", param=param, code="invalid_cursor")
