"""Stored chat completions (`store: true`), and conversation metadata.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "chat_completions",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("key_id", sa.String(64), nullable=True),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("completion", sa.JSON(), nullable=False),
        sa.Column("messages", sa.JSON(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_chat_completions"),
    )
    op.create_index("ix_chat_completions_key_id_created_at", "chat_completions", ["key_id", "created_at"])
    op.create_index("ix_chat_completions_key_id_model_created_at", "chat_completions", ["key_id", "model", "created_at"])
    op.create_index("ix_chat_completions_created_at", "chat_completions", ["created_at"])
    with op.batch_alter_table("conversations") as batch:
        batch.add_column(sa.Column("metadata", sa.JSON(), nullable=False, server_default=sa.text("'{}'")))


def downgrade() -> None:
    with op.batch_alter_table("conversations") as batch:
        batch.drop_column("metadata")
    op.drop_index("ix_chat_completions_created_at", table_name="chat_completions")
    op.drop_index("ix_chat_completions_key_id_model_created_at", table_name="chat_completions")
    op.drop_index("ix_chat_completions_key_id_created_at", table_name="chat_completions")
    op.drop_table("chat_completions")
