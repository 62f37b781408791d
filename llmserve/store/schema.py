"""The tables: API keys, usage records, conversations and their messages, stored Responses API responses.

Migrations 0001 and 0002 create exactly this schema; tests/store/test_migrations.py checks that they agree.
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


def row_values(row: Base) -> dict[str, Any]:
    """A row's column values by attribute name (for turning rows into frozen dataclasses)."""
    return {column.key: getattr(row, column.key) for column in row.__table__.columns}
