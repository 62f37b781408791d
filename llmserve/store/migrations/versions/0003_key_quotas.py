"""Token quotas on API keys: tokens per UTC day, week or month, or in total.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("token_quota", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("quota_period", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("quota_period")
        batch.drop_column("token_quota")
