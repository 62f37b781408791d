"""A stored conversation keeps tool calls and their outputs (an assistant's call of a tool, and the id of the call
a tool message answers), and reasoning items.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.add_column(sa.Column("tool_call", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("tool_call_id", sa.String(255), nullable=True))
        batch.add_column(sa.Column("reasoning", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("messages") as batch:
        batch.drop_column("reasoning")
        batch.drop_column("tool_call_id")
        batch.drop_column("tool_call")
