"""Database fixtures for the storage and platform tests: every test runs on SQLite and PostgreSQL.

Import the fixtures you use into a test module: `db` (a migrated database with empty tables, shared
by the tests of a session) needs `db_fixture` and `shared_db_fixture`; `db_url` (a fresh, empty
database's URL) needs `db_url_fixture`.
Each PostgreSQL test gets its own schema (through `search_path`), dropped afterwards, so parallel
runs and other tests never see each other's tables; its sessions also run in a non-UTC time zone
to show that nothing depends on the server's zone. Set LLMSERVE_TEST_POSTGRES_URL to use another
server; without one reachable the PostgreSQL cases are skipped.
"""

from __future__ import annotations

import functools
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, event, make_url, text

from llmserve.store.db import Database, open_database
from llmserve.store.schema import Base

POSTGRES_URL = os.environ.get("LLMSERVE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
BACKENDS = ["sqlite", "postgresql"]
SESSION_TIME_ZONE = "Asia/Kolkata"  # UTC+05:30: a day boundary that differs from UTC's


@functools.cache
def postgres_unreachable_reason() -> str | None:
    engine = create_engine(POSTGRES_URL, connect_args={"connect_timeout": 3})
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except Exception as exc:
        return f"PostgreSQL at {POSTGRES_URL} is unreachable: {str(exc).splitlines()[0]}"
    finally:
        engine.dispose()
    return None


def postgres_url(schema: str, *options: str) -> str:
    """POSTGRES_URL with `search_path` set to `schema` plus extra `-c` settings (`name=value`)."""
    settings = " ".join(f"-c{setting}" for setting in (f"search_path={schema}", *options))
    url = make_url(POSTGRES_URL).update_query_dict({"options": settings})
    return url.render_as_string(hide_password=False)


def add_postgres_options(url: str, *options: str) -> str:
    """`url` with more `-c name=value` settings appended to its connection options."""
    parsed = make_url(url)
    settings = " ".join([parsed.query.get("options", ""), *(f"-c{setting}" for setting in options)]).strip()
    return parsed.update_query_dict({"options": settings}).render_as_string(hide_password=False)


@contextmanager
def postgres_schema() -> Iterator[str]:
    """A fresh, uniquely named schema, dropped with everything in it at the end."""
    reason = postgres_unreachable_reason()
    if reason:
        pytest.skip(reason)
    schema = f"llmserve_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(POSTGRES_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE SCHEMA "{schema}"'))
        yield schema
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


@contextmanager
def recorded_statements(engine: Engine) -> Iterator[list[str]]:
    """Every SQL statement `engine` sends while the block runs (to show that something sends none)."""
    statements: list[str] = []

    def record(_conn: object, _cursor: object, statement: str, *_args: object) -> None:
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield statements
    finally:
        event.remove(engine, "before_cursor_execute", record)


def sqlite_url(directory: Path) -> str:
    return f"sqlite:///{directory / 'llmserve.db'}"


@pytest.fixture(name="db_url", params=BACKENDS)
def db_url_fixture(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database's URL (not migrated), on each backend."""
    if request.param == "sqlite":
        yield sqlite_url(tmp_path)
        return
    with postgres_schema() as schema:
        yield postgres_url(schema, f"timezone={SESSION_TIME_ZONE}")


@pytest.fixture(name="shared_db", scope="session", params=BACKENDS)
def shared_db_fixture(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Database]:
    """One migrated database per backend for the whole session (migrating per test is slow)."""
    if request.param == "sqlite":
        database = open_database(sqlite_url(tmp_path_factory.mktemp("db")))
        yield database
        database.dispose()
        return
    with postgres_schema() as schema:
        database = open_database(postgres_url(schema, f"timezone={SESSION_TIME_ZONE}"))
        yield database
        database.dispose()


@pytest.fixture(name="db")
def db_fixture(shared_db: Database) -> Database:
    """A migrated database with empty tables, on each backend."""
    with shared_db.session(write=True) as session:
        for table in reversed(Base.metadata.sorted_tables):
            session.execute(table.delete())
    return shared_db
