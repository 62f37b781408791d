"""Where llmserve keeps its data: the database URL, the engine, sessions and schema migrations.

The default is a SQLite file in the data directory; `postgresql+psycopg://user@host/db` selects
PostgreSQL. All access is synchronous SQLAlchemy with one session per call, so the server runs it
in worker threads and never on the event loop.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.util import CommandError
from sqlalchemy import Engine, create_engine, event, make_url, text
from sqlalchemy.engine import URL
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import StaticPool

from llmserve.errors import LLMServeError
from llmserve.store.files import ensure_private_file

DATABASE_FILENAME = "llmserve.db"
MIGRATIONS_DIR = Path(__file__).parent / "migrations"
SUPPORTED_BACKENDS = ("sqlite", "postgresql")
SQLITE_BUSY_TIMEOUT_S = 10.0
POSTGRES_CONNECT_TIMEOUT_S = 10
# Any constant works: it only has to be the same for every llmserve process migrating one database.
_MIGRATION_LOCK_ID = 0x6C6C6D73
_BEGIN_IMMEDIATE = "llmserve_sqlite_begin_immediate"


class DatabaseUnavailableError(LLMServeError):
    """The database could not be reached (server down, wrong host, bad credentials)."""


def default_data_dir() -> Path:
    """$LLMSERVE_DATA_DIR, else $XDG_DATA_HOME/llmserve, else ~/.local/share/llmserve."""
    explicit = os.environ.get("LLMSERVE_DATA_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "llmserve"


def default_database_url() -> str:
    """The SQLite file `llmserve.db` in the data directory."""
    return f"sqlite:///{default_data_dir() / DATABASE_FILENAME}"


def parse_database_url(url: str) -> URL:
    """Parse and check a database URL; `postgresql://` means psycopg 3. Raises ValueError."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise ValueError(f"invalid database URL {url!r}: expected sqlite:///PATH or postgresql+psycopg://...") from exc
    if parsed.get_backend_name() not in SUPPORTED_BACKENDS:
        raise ValueError(
            f"unsupported database {parsed.get_backend_name()!r} in {parsed.render_as_string()!r}: "
            "use sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"
        )
    if parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


class Database:
    """An engine plus session factory for one database URL.

    `session(write=True)` on SQLite starts with BEGIN IMMEDIATE so that a read-then-write
    transaction waits for the write lock (busy timeout) instead of failing when another
    connection wrote in between.
    """

    def __init__(self, url: str) -> None:
        self.url = parse_database_url(url)
        self.engine: Engine = _create_engine(self.url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @property
    def display_url(self) -> str:
        return self.url.render_as_string(hide_password=True)

    @contextmanager
    def session(self, *, write: bool = False) -> Iterator[Session]:
        """A session in one transaction: committed on success, rolled back on an exception."""
        with self._sessions.begin() as session:
            if write and self.dialect == "sqlite":
                session.connection(execution_options={_BEGIN_IMMEDIATE: True})
            yield session

    def migrate(self) -> None:
        """Bring the schema to the newest revision (creating it on an empty database)."""
        config = alembic_config()
        try:
            with self.engine.connect() as connection:
                if self.dialect == "sqlite":
                    connection = connection.execution_options(**{_BEGIN_IMMEDIATE: True})
                with connection.begin():
                    if self.dialect == "postgresql":
                        # Serialises concurrent starts (server and `llmserve keys`) on one database.
                        connection.execute(text("SELECT pg_advisory_xact_lock(:lock)"), {"lock": _MIGRATION_LOCK_ID})
                    config.attributes["connection"] = connection
                    command.upgrade(config, "head")
        except OperationalError as exc:
            raise self._unavailable(exc) from exc
        except CommandError as exc:  # e.g. the database was migrated by a newer llmserve
            raise LLMServeError(f"cannot migrate the database at {self.display_url}: {exc}") from exc

    def check_connection(self) -> None:
        """Raise DatabaseUnavailableError unless a trivial query succeeds."""
        try:
            with self.engine.connect() as connection:
                connection.execute(text("SELECT 1"))
        except OperationalError as exc:
            raise self._unavailable(exc) from exc

    def dispose(self) -> None:
        self.engine.dispose()

    def _unavailable(self, exc: OperationalError) -> DatabaseUnavailableError:
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else str(exc)
        return DatabaseUnavailableError(f"cannot use the database at {self.display_url}: {reason}")


def alembic_config() -> Config:
    """An Alembic config for llmserve's migrations. Put a connection in `config.attributes["connection"]`
    to run a command against it, e.g. to write a new revision after changing schema.py::

        with database.engine.begin() as connection:
            config.attributes["connection"] = connection
            alembic.command.revision(config, "add a column", autogenerate=True)
    """
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("path_separator", "os")
    return config


def open_database(url: str | None = None) -> Database:
    """Create a Database for `url` (default: the SQLite file in the data directory) and migrate it."""
    database = Database(url or default_database_url())
    try:
        database.migrate()
    except BaseException:
        database.dispose()
        raise
    return database


def _create_engine(url: URL) -> Engine:
    try:
        if url.get_backend_name() == "sqlite":
            return _create_sqlite_engine(url)
        return _create_postgres_engine(url)
    except (NoSuchModuleError, ImportError) as exc:
        raise ValueError(
            f"database driver {url.drivername!r} is not available: use sqlite:///PATH or postgresql+psycopg://..."
        ) from exc


def _create_postgres_engine(url: URL) -> Engine:
    connect_args: dict[str, Any] = {}
    if "connect_timeout" not in url.query:
        connect_args["connect_timeout"] = POSTGRES_CONNECT_TIMEOUT_S
    return create_engine(url, connect_args=connect_args, pool_pre_ping=True)


def _create_sqlite_engine(url: URL) -> Engine:
    in_memory = url.database in (None, "", ":memory:")
    # How long a writer waits for another's lock; `?timeout=SECONDS` in the URL overrides it.
    busy_timeout_s = float(url.query.get("timeout", SQLITE_BUSY_TIMEOUT_S))
    engine = create_engine(
        url,
        connect_args={"check_same_thread": False, "timeout": busy_timeout_s},
        # An in-memory database exists per connection, so every thread must share one.
        poolclass=StaticPool if in_memory else None,
    )
    if not in_memory and not url.query.get("uri"):
        # After create_engine, so a URL it refuses leaves no file behind; before the first connection,
        # so SQLite gives the -wal and -shm files this file's 0600 mode.
        ensure_private_file(url.database)
    event.listen(engine, "connect", partial(_configure_sqlite_connection, busy_timeout_ms=int(busy_timeout_s * 1000)))
    event.listen(engine, "begin", _begin_sqlite_transaction)
    return engine


def _configure_sqlite_connection(dbapi_connection: Any, _record: Any, *, busy_timeout_ms: int) -> None:
    # Take transaction control away from the sqlite3 module; `_begin_sqlite_transaction` emits BEGIN.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


def _begin_sqlite_transaction(connection: Any) -> None:
    immediate = connection.get_execution_options().get(_BEGIN_IMMEDIATE, False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")
