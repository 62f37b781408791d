"""Database URLs, the data directory, SQLite settings and clear errors for bad or unreachable databases."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
from sqlalchemy import text

from llmserve.store.db import (
    Database,
    DatabaseUnavailableError,
    default_data_dir,
    default_database_url,
    open_database,
    parse_database_url,
)
from llmserve.store.files import open_private


def test_data_dir_prefers_llmserve_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMSERVE_DATA_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_data_dir() == tmp_path / "explicit"
    assert default_database_url() == f"sqlite:///{tmp_path / 'explicit' / 'llmserve.db'}"


def test_data_dir_falls_back_to_xdg_then_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LLMSERVE_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_data_dir() == tmp_path / "xdg" / "llmserve"
    monkeypatch.delenv("XDG_DATA_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_data_dir() == tmp_path / "home" / ".local" / "share" / "llmserve"


def test_open_database_creates_the_sqlite_file_and_its_directory(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "dir" / "llmserve.db"
    database = open_database(f"sqlite:///{path}")
    try:
        assert path.is_file()
        database.check_connection()  # raises if it cannot
        with database.engine.connect() as connection:
            assert connection.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert connection.execute(text("PRAGMA busy_timeout")).scalar() == 10_000
            assert connection.execute(text("PRAGMA foreign_keys")).scalar() == 1
    finally:
        database.dispose()


def test_sqlite_busy_timeout_comes_from_the_url(tmp_path: Path) -> None:
    database = Database(f"sqlite:///{tmp_path / 'x.db'}?timeout=0.25")
    try:
        with database.engine.connect() as connection:
            assert connection.execute(text("PRAGMA busy_timeout")).scalar() == 250
    finally:
        database.dispose()


@pytest.mark.parametrize(
    "url", ["not a url", "mysql://u@h/db", "oracle://scott@h/x", "postgresql+nodriver://u@h/db", "sqlite+nope:///x"]
)
def test_bad_or_unsupported_urls_raise_value_error(url: str) -> None:
    with pytest.raises(ValueError, match=r"sqlite:///.*postgresql\+psycopg://"):
        Database(url)


def test_a_refused_sqlite_url_leaves_no_file_behind(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        Database(f"sqlite+nope:///{tmp_path / 'llmserve.db'}")
    assert list(tmp_path.iterdir()) == []


def test_plain_postgresql_url_means_psycopg() -> None:
    assert parse_database_url("postgresql://u@h/db").drivername == "postgresql+psycopg"


def test_unreachable_postgres_is_a_clear_error() -> None:
    database = Database("postgresql+psycopg://postgres:secret@127.0.0.1:1/nothing")
    started = time.monotonic()
    with pytest.raises(DatabaseUnavailableError) as info:
        database.migrate()
    assert time.monotonic() - started < 10
    message = str(info.value)
    assert message.startswith("cannot use the database at postgresql+psycopg://postgres:***@127.0.0.1:1/nothing: ")
    assert "secret" not in message
    with pytest.raises(DatabaseUnavailableError):
        database.check_connection()
    database.dispose()



def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_data_files_are_private_to_their_owner_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "data" / "nested" / "llmserve.db"
    previous = os.umask(0)
    try:
        database = open_database(f"sqlite:///{path}")
        try:
            with database.session(write=True) as session:
                session.execute(text("CREATE TABLE t (x INTEGER)"))
            files = sorted(p.name for p in path.parent.iterdir())
            modes = {name: _mode(path.parent / name) for name in files}
        finally:
            database.dispose()
        (tmp_path / "shared").mkdir(mode=0o755)
        with open_private(tmp_path / "shared" / "journal" / "usage.log") as journal:
            journal.write(b"record\n")
    finally:
        os.umask(previous)
    assert files == ["llmserve.db", "llmserve.db-shm", "llmserve.db-wal"]
    assert modes == dict.fromkeys(files, 0o600)
    assert _mode(tmp_path / "data") == _mode(path.parent) == _mode(tmp_path / "shared" / "journal") == 0o700
    assert _mode(tmp_path / "shared" / "journal" / "usage.log") == 0o600
    assert (tmp_path / "shared" / "journal" / "usage.log").read_bytes() == b"record\n"
    assert _mode(tmp_path / "shared") == 0o755  # an existing directory is left as it was
