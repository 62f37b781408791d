"""Files expire: an uploaded file at its `expires_after` (a batch's input, 30 days unless asked otherwise), a batch's
output and error files at the batch's `output_expires_after`.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch.create_index("ix_files_expires_at", ["expires_at"])
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("output_expires_after", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.drop_column("output_expires_after")
    with op.batch_alter_table("files") as batch:
        batch.drop_index("ix_files_expires_at")
        batch.drop_column("expires_at")
