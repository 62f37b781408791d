"""The Alembic migrations build exactly the schema the models describe, on SQLite and PostgreSQL."""

from __future__ import annotations

import os
from pathlib import Path

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect, select, text

from llmserve.store.db import MIGRATIONS_DIR, Database, alembic_config, open_database
from llmserve.store.schema import ApiKeyRow, Base, utcnow
from tests.store.fixtures import db_url_fixture, sqlite_url  # noqa: F401

TABLES = {"api_keys", "usage_records", "conversations", "messages", "responses", "files", "batches", "batch_results",
          "chat_completions"}


def _current_revision(database: Database) -> str | None:
    with database.engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def test_migrated_schema_matches_the_models(db_url: str) -> None:
    database = open_database(db_url)
    try:
        with database.engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
            assert set(inspect(connection).get_table_names()) == TABLES | {"alembic_version"}
        assert _current_revision(database) == "0008"
    finally:
        database.dispose()


def test_migrating_again_keeps_the_data(db_url: str) -> None:
    first = open_database(db_url)
    with first.session(write=True) as session:
        session.add(ApiKeyRow(
            id="key_1", name="kept", prefix="sk-llms-abcd", secret_hash="0" * 64, tier="default",
            is_admin=False, created_at=utcnow(),
        ))
    first.dispose()

    second = open_database(db_url)
    try:
        with second.session() as session:
            assert session.scalars(select(ApiKeyRow.name)).all() == ["kept"]
        assert _current_revision(second) == "0008"
    finally:
        second.dispose()


def test_downgrade_removes_the_tables_and_upgrade_restores_them(db_url: str) -> None:
    database = open_database(db_url)
    try:
        config = alembic_config()
        with database.engine.begin() as connection:
            config.attributes["connection"] = connection
            command.downgrade(config, "base")
        with database.engine.connect() as connection:
            assert set(inspect(connection).get_table_names()) == {"alembic_version"}
            assert connection.execute(text("SELECT count(*) FROM alembic_version")).scalar() == 0

        database.migrate()
        with database.engine.connect() as connection:
            assert set(inspect(connection).get_table_names()) == TABLES | {"alembic_version"}
    finally:
        database.dispose()



def test_a_new_revision_from_the_template_has_nothing_to_do(tmp_path: Path) -> None:
    """The shipped template renders, and autogenerate sees no difference between models and migrations."""
    database = open_database(sqlite_url(tmp_path))
    config = alembic_config()
    config.set_main_option("version_locations", os.pathsep.join([str(MIGRATIONS_DIR / "versions"), str(tmp_path)]))
    try:
        with database.engine.begin() as connection:
            config.attributes["connection"] = connection
            script = command.revision(config, "nothing", autogenerate=True, rev_id="9999", version_path=str(tmp_path))
    finally:
        database.dispose()
    source = Path(script.path).read_text()
    compile(source, script.path, "exec")
    assert "down_revision = '0008'" in source
    operations = source.replace("from alembic import op", "")
    assert "op." not in operations  # autogenerate writes an op.* call for every difference


def test_keys_made_before_quotas_existed_migrate_without_one(db_url: str) -> None:
    database = Database(db_url)
    try:
        config = alembic_config()
        with database.engine.begin() as connection:
            config.attributes["connection"] = connection
            command.upgrade(config, "0002")
            connection.execute(text(
                "INSERT INTO api_keys (id, name, prefix, secret_hash, tier, rpm, is_admin, created_at)"
                " VALUES ('key_old', 'old', 'sk-llms-abcd', :hash, 'default', 5, false, :now)"
            ), {"hash": "1" * 64, "now": utcnow()})
        database.migrate()
        with database.session() as session:
            row = session.get(ApiKeyRow, "key_old")
            assert (row.name, row.rpm, row.token_quota, row.quota_period) == ("old", 5, None, None)
        assert _current_revision(database) == "0008"
    finally:
        database.dispose()
