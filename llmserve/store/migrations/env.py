"""Alembic environment for llmserve's schema.

`Database.migrate()` runs it with its own connection (in `config.attributes["connection"]`); the
`alembic` command line can run it too, given `sqlalchemy.url` in its config (or
`alembic -x url=...`).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection

from llmserve.store.schema import Base

target_metadata = Base.metadata


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot alter most constraints in place; batch mode recreates the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _url() -> str:
    return context.get_x_argument(as_dictionary=True).get("url") or context.config.get_main_option("sqlalchemy.url")


def run_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        return
    from llmserve.store.db import Database

    database = Database(_url())
    try:
        with database.engine.connect() as connection:
            _configure(connection)
    finally:
        database.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
