"""`llmserve keys create|list|update|revoke` end to end, against SQLite and PostgreSQL."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llmserve.cli import main
from llmserve.platform.keys import KeyStore
from llmserve.store.db import open_database
from tests.store.fixtures import db_url_fixture  # noqa: F401

SECRET_LINE = re.compile(r"^(sk-llms-[A-Za-z0-9_-]{43})$", re.MULTILINE)


def run_keys(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["keys", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_create_prints_the_secret_once_and_stores_the_key(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_keys(
        capsys, "create", "--name", "ci", "--tier", "gold", "--rpm", "60", "--tpm", "5000",
        "--models", "tiny-llama,other", "--admin", "--database-url", db_url,
    )
    assert (status, err) == (0, "")
    secret = SECRET_LINE.search(out).group(1)
    assert "This secret will not be shown again" in out
    assert "rpm 60, tpm 5000, quota unlimited, models tiny-llama,other, admin" in out

    database = open_database(db_url)
    try:
        key = KeyStore(database).lookup(secret)
    finally:
        database.dispose()
    assert (key.name, key.tier, key.rpm, key.tpm, key.models, key.is_admin) == (
        "ci", "gold", 60, 5000, ("tiny-llama", "other"), True,
    )


def test_list_shows_keys_without_secrets_and_revoke_removes_them(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _, created, _ = run_keys(capsys, "create", "--name", "alpha", "--database-url", db_url)
    secret = SECRET_LINE.search(created).group(1)
    run_keys(capsys, "create", "--name", "beta", "--rpm", "10", "--database-url", db_url)

    status, listing, _ = run_keys(capsys, "list", "--database-url", db_url)
    assert status == 0
    lines = listing.splitlines()
    assert lines[0].split() == [
        "ID", "NAME", "PREFIX", "TIER", "RPM", "TPM", "QUOTA", "MODELS", "ADMIN", "CREATED", "(UTC)",
    ]
    assert [line.split()[1] for line in lines[1:]] == ["alpha", "beta"]
    assert lines[1].split()[2] == secret[:12] + "..."
    assert lines[2].split()[3:9] == ["default", "10", "unlimited", "unlimited", "all", "no"]
    assert secret not in listing

    status, out, _ = run_keys(capsys, "revoke", "alpha", "--database-url", db_url)
    assert status == 0 and out.startswith("Revoked key key_") and "named 'alpha'" in out
    _, listing, _ = run_keys(capsys, "list", "--database-url", db_url)
    assert [line.split()[1] for line in listing.splitlines()[1:]] == ["beta"]
    _, listing, _ = run_keys(capsys, "list", "--all", "--database-url", db_url)
    assert [line.split()[1] for line in listing.splitlines()[1:]] == ["alpha", "beta"]
    assert listing.splitlines()[2].split()[-1] == "-"  # beta: not revoked


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["create", "--name", "x", "--rpm", "-5"], "error: rpm must be a positive integer, got -5\n"),
        (["create", "--name", "x", "--tpm", "0"], "error: tpm must be a positive integer, got 0\n"),
        (["create", "--name", "x", "--models", ""], "error: models must be a non-empty list"),
        (["revoke", "ghost"], "error: no key with id or active name 'ghost'\n"),
        (["create", "--name", "x", "--token-quota", "0"], "error: token_quota must be a positive integer, got 0\n"),
        (["create", "--name", "x", "--tpm", "99999999999"], "error: tpm must be at most 2147483647, got 99999999999\n"),
        (["create", "--name", "x", "--token-quota", str(2**63)],
         f"error: token_quota must be at most {2**63 - 1}, got {2**63}\n"),
        (["update", "ghost", "--rpm", "5"], "error: no active key with id or name 'ghost'\n"),
        (["update", "ghost"], "error: give at least one thing to change"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    db_url: str, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    status, out, err = run_keys(capsys, *argv, "--database-url", db_url)
    assert status == 2 and out == ""
    assert err.startswith(message) and err.count("\n") == 1


def test_a_duplicate_active_name_exits_2(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_keys(capsys, "create", "--name", "twice", "--database-url", db_url)[0] == 0
    status, _, err = run_keys(capsys, "create", "--name", "twice", "--database-url", db_url)
    assert (status, err) == (2, "error: an active key named 'twice' already exists\n")


def test_a_bad_database_url_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_keys(capsys, "list", "--database-url", "mysql://u@h/db")
    assert status == 2 and err.startswith("error: unsupported database 'mysql'")


def test_a_non_integer_rpm_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["keys", "create", "--name", "x", "--rpm", "many"])
    assert info.value.code == 2
    assert "argument --rpm: invalid int value: 'many'" in capsys.readouterr().err


def test_the_command_uses_the_data_directory_by_default(tmp_path: Path) -> None:
    env = {**os.environ, "LLMSERVE_DATA_DIR": str(tmp_path / "data")}
    worktree = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(worktree), env.get("PYTHONPATH")]))
    created = subprocess.run(
        [sys.executable, "-m", "llmserve.cli", "keys", "create", "--name", "from-shell"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )
    assert created.returncode == 0, created.stderr
    secret = SECRET_LINE.search(created.stdout).group(1)

    database = open_database(f"sqlite:///{tmp_path / 'data' / 'llmserve.db'}")
    try:
        assert KeyStore(database).lookup(secret).name == "from-shell"
    finally:
        database.dispose()


def test_a_token_quota_is_created_listed_and_updated(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_keys(capsys, "create", "--name", "metered", "--token-quota", "50000", "--quota-period", "day",
                              "--database-url", db_url)
    assert status == 0 and "quota 50000 tokens per day" in out
    _, listing, _ = run_keys(capsys, "list", "--database-url", db_url)
    assert listing.splitlines()[1].split()[6] == "50000/day"

    status, out, _ = run_keys(capsys, "update", "metered", "--token-quota", "80000", "--tpm", "900",
                              "--database-url", db_url)
    assert status == 0 and "tpm 900, quota 80000 tokens per day" in out  # the period is kept
    status, out, _ = run_keys(capsys, "update", "metered", "--quota-period", "total", "--database-url", db_url)
    assert status == 0 and "quota 80000 tokens in total" in out
    status, out, _ = run_keys(capsys, "update", "metered", "--token-quota", "none", "--tpm", "none",
                              "--models", "a,b", "--tier", "gold", "--database-url", db_url)
    assert status == 0 and "tier gold, rpm unlimited, tpm unlimited, quota unlimited, models a,b" in out

    database = open_database(db_url)
    try:
        (key,) = KeyStore(database).list()
    finally:
        database.dispose()
    assert (key.token_quota, key.quota_period, key.tpm, key.models) == (None, None, None, ("a", "b"))


def test_a_quota_given_alone_renews_monthly_and_a_period_alone_is_refused(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = run_keys(capsys, "create", "--name", "m", "--token-quota", "10", "--database-url", db_url)
    assert status == 0 and "quota 10 tokens per month" in out
    status, _, err = run_keys(capsys, "create", "--name", "p", "--quota-period", "day", "--database-url", db_url)
    assert (status, err) == (2, "error: quota_period needs a token_quota\n")


def test_the_cli_offers_exactly_the_quota_periods_and_what_can_be_updated() -> None:
    from llmserve.platform import keys, keys_cli
    from llmserve.platform.quota import QUOTA_PERIODS

    assert keys_cli.QUOTA_PERIOD_CHOICES == QUOTA_PERIODS
    assert keys_cli.UPDATABLE == keys.UPDATABLE
