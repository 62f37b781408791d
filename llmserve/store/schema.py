"""The tables: API keys, usage records, conversations and their messages, stored Responses API responses, stored chat
completions, and the Batch API's files, batches and each batch request's result.

The migrations create exactly this schema; tests/store/test_migrations.py checks that they agree.
Timestamps are timezone-aware UTC in Python on every backend (`UTCDateTime`).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

ID_LENGTH = 64
NAME_LENGTH = 200
REQUEST_ID_LENGTH = 255
MODEL_NAME_LENGTH = 255

# Deterministic constraint names, so later migrations can refer to them on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """TIMESTAMPTZ on PostgreSQL, naive-UTC text on SQLite; aware UTC datetimes in Python either way.

    Naive datetimes given to it are taken to be UTC already.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        value = as_utc(value)
        # SQLite compares timestamps as text, so every stored value must be in the same (UTC) zone.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else as_utc(value)


def as_utc(value: datetime) -> datetime:
    """`value` in UTC; a naive datetime is taken to be UTC."""
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime()}


class ApiKeyRow(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LENGTH))
    prefix: Mapped[str] = mapped_column(String(32))  # the secret's first characters, for display
    secret_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the secret
    tier: Mapped[str] = mapped_column(String(64), default="default")
    rpm: Mapped[int | None]  # requests per minute; NULL: unlimited
    tpm: Mapped[int | None]  # tokens per minute; NULL: unlimited
    token_quota: Mapped[int | None] = mapped_column(BigInteger)  # tokens per quota_period; NULL: unlimited
    quota_period: Mapped[str | None] = mapped_column(String(16))  # day, week, month or total
    models: Mapped[list[str] | None] = mapped_column(JSON)  # NULL: every model
    is_admin: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]

    __table_args__ = (
        # A name identifies one active key; revoked keys keep theirs for the record.
        Index(
            "uq_api_keys_active_name", "name", unique=True,
            sqlite_where=text("revoked_at IS NULL"), postgresql_where=text("revoked_at IS NULL"),
        ),
    )


class UsageRecordRow(Base):
    __tablename__ = "usage_records"

    request_id: Mapped[str] = mapped_column(String(REQUEST_ID_LENGTH), primary_key=True)
    # No foreign key: a usage write must never fail (and be retried forever) over a key row.
    key_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    model: Mapped[str] = mapped_column(String(MODEL_NAME_LENGTH))
    prompt_tokens: Mapped[int] = mapped_column(default=0)
    completion_tokens: Mapped[int] = mapped_column(default=0)
    cached_tokens: Mapped[int] = mapped_column(default=0)
    status: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime]  # when the request arrived
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    latency_ms: Mapped[float | None] = mapped_column(Float)

    __table_args__ = (
        Index("ix_usage_records_created_at", "created_at"),
        Index("ix_usage_records_key_id_created_at", "key_id", "created_at"),
    )


class ConversationRow(Base):
    __tablename__ = "conversations"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    key_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))  # NULL: local mode (no API keys)
    title: Mapped[str | None] = mapped_column(String(NAME_LENGTH))
    model: Mapped[str | None] = mapped_column(String(MODEL_NAME_LENGTH))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    deleted_at: Mapped[datetime | None]
    # The newest message of the active branch. Not a foreign key: the two tables would refer to
    # each other, which SQLite cannot add after creating them.
    head_message_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    # OpenAI's conversation metadata, under the column's name (`metadata` is the declarative base's own attribute).
    tags: Mapped[dict[str, str]] = mapped_column("metadata", JSON, server_default=text("'{}'"))

    __table_args__ = (
        Index("ix_conversations_key_id_created_at", "key_id", "created_at"),
        Index("ix_conversations_deleted_at", "deleted_at"),
    )


class MessageRow(Base):
    __tablename__ = "messages"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    conversation_id: Mapped[str] = mapped_column(
        String(ID_LENGTH), ForeignKey("conversations.id", ondelete="CASCADE"), index=True
    )
    parent_id: Mapped[str | None] = mapped_column(
        String(ID_LENGTH), ForeignKey("messages.id", ondelete="CASCADE"), index=True
    )
    role: Mapped[str] = mapped_column(String(32))
    content: Mapped[str] = mapped_column(Text)
    # A message with images: its content parts as OpenAI's API takes them (text, and image_url parts with their URLs).
    parts: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    # An assistant's call of a tool (one row a call, as OpenAI's function_call items): {"call_id", "name",
    # "arguments"}; and a tool's output (role "tool"): the id of the call it answers.
    tool_call: Mapped[dict[str, str] | None] = mapped_column(JSON)
    tool_call_id: Mapped[str | None] = mapped_column(String(REQUEST_ID_LENGTH))
    # An assistant's reasoning (OpenAI's reasoning items; `content` is its text): {"summary": [its summary_text
    # parts], "encrypted_content"?: as the client sent it}.
    reasoning: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    token_count: Mapped[int | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ResponseRow(Base):
    """A Responses API response kept for GET /v1/responses/{id} and for `previous_response_id`: the response as
    answered, and the input items its request sent (the earlier context is its previous response's)."""

    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    key_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))  # NULL: local mode (no API keys)
    # Not a foreign key: deleting a response leaves the ones after it, which then cannot be continued.
    previous_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    model: Mapped[str] = mapped_column(String(MODEL_NAME_LENGTH))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    response: Mapped[dict[str, Any]] = mapped_column(JSON)
    input_items: Mapped[list[dict[str, Any]]] = mapped_column(JSON)

    __table_args__ = (Index("ix_responses_created_at", "created_at"),)


class ChatCompletionRow(Base):
    """A chat completion made with `store: true`, kept for GET /v1/chat/completions(/{id}(/messages)): the completion
    as answered, the messages its request sent, and the metadata it is listed by (which may be changed later)."""

    __tablename__ = "chat_completions"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    key_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))  # NULL: local mode (no API keys)
    model: Mapped[str] = mapped_column(String(MODEL_NAME_LENGTH))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    completion: Mapped[dict[str, Any]] = mapped_column(JSON)
    messages: Mapped[list[dict[str, Any]]] = mapped_column(JSON)
    # `metadata` is the declarative base's own attribute: the column keeps OpenAI's name, the attribute another.
    tags: Mapped[dict[str, str]] = mapped_column("metadata", JSON)

    __table_args__ = (Index("ix_chat_completions_key_id_created_at", "key_id", "created_at"),
                      Index("ix_chat_completions_key_id_model_created_at", "key_id", "model", "created_at"),
                      Index("ix_chat_completions_created_at", "created_at"))


class FileRow(Base):
    """A file of the Files API: a batch's input, uploaded (`purpose` "batch"), or its output or errors, written
    when it ends ("batch_output")."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    key_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))  # NULL: local mode (no API keys)
    filename: Mapped[str] = mapped_column(String(NAME_LENGTH))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(BigInteger)
    content: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime | None] = mapped_column(index=True)  # NULL: kept until deleted

    __table_args__ = (Index("ix_files_key_id_created_at", "key_id", "created_at"),)


class BatchRow(Base):
    """A batch of the Batch API: its input file's requests, run by one server at a time (the one whose lease on it
    is current), each request's result kept as it comes (`BatchResultRow`), the output files written at the end."""

    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    key_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))  # NULL: local mode (no API keys)
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(ID_LENGTH))  # not a foreign key: the file may be deleted
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    metadata_: Mapped[dict[str, str] | None] = mapped_column("metadata", JSON)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    output_file_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    error_file_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    total: Mapped[int] = mapped_column(default=0)
    completed: Mapped[int] = mapped_column(default=0)
    failed: Mapped[int] = mapped_column(default=0)
    usage: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # its answers' tokens, once it has ended
    output_expires_after: Mapped[int | None]  # seconds its output and error files are kept; NULL: until deleted
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime]
    in_progress_at: Mapped[datetime | None]
    finalizing_at: Mapped[datetime | None]
    completed_at: Mapped[datetime | None]
    failed_at: Mapped[datetime | None]
    expired_at: Mapped[datetime | None]
    cancelling_at: Mapped[datetime | None]
    cancelled_at: Mapped[datetime | None]
    runner: Mapped[str | None] = mapped_column(String(ID_LENGTH))  # the server running it
    lease_until: Mapped[datetime | None]  # when another server may take it over

    __table_args__ = (
        Index("ix_batches_key_id_created_at", "key_id", "created_at"),
        Index("ix_batches_status", "status"),
    )


class BatchResultRow(Base):
    """One request of a batch, once it has an answer: the line of the output (or error) file it becomes."""

    __tablename__ = "batch_results"

    batch_id: Mapped[str] = mapped_column(
        String(ID_LENGTH), ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True
    )
    line: Mapped[int] = mapped_column(primary_key=True)  # the request's line in the input file, from 0
    succeeded: Mapped[bool]
    record: Mapped[dict[str, Any]] = mapped_column(JSON)


def row_values(row: Base) -> dict[str, Any]:
    """A row's column values by attribute name (for turning rows into frozen dataclasses)."""
    return {column.key: getattr(row, column.key) for column in row.__table__.columns}
