"""`llmserve keys create|list|update|revoke`: manage API keys in the server's database.

Only argparse loads at import, so building the `llmserve` parser stays cheap; SQLAlchemy and
Alembic load when a keys command runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from llmserve.errors import LLMServeError

if TYPE_CHECKING:
    from llmserve.platform.keys import ApiKey, KeyStore

EXIT_BAD_INPUT = 2
QUOTA_PERIOD_CHOICES = ("day", "week", "month", "total")  # platform.quota.QUOTA_PERIODS, without loading it
UPDATABLE = ("rpm", "tpm", "models", "token_quota", "quota_period", "tier")  # keys.UPDATABLE, without loading it


def add_keys_parser(subparsers: argparse._SubParsersAction) -> None:
    keys = subparsers.add_parser("keys", help="create, list, update and revoke API keys")
    actions = keys.add_subparsers(dest="keys_command", required=True)

    create = actions.add_parser("create", help="create a key and print its secret (shown only once)")
    create.add_argument("--name", required=True, help="a unique name among active keys")
    create.add_argument("--tier", default="default",
                        help="the key's tier, which the config's `tiers` may give a scheduling priority (default: default)")
    create.add_argument("--rpm", type=int, default=None, help="requests per minute (default: unlimited)")
    create.add_argument("--tpm", type=int, default=None, help="tokens per minute (default: unlimited)")
    create.add_argument("--models", default=None, help="comma-separated models this key may use (default: all)")
    create.add_argument("--admin", action="store_true", help="an admin key sees every key's usage")
    create.add_argument("--token-quota", type=int, default=None,
                        help="tokens (prompt plus completion) per quota period (default: unlimited)")
    create.add_argument("--quota-period", choices=QUOTA_PERIOD_CHOICES, default=None,
                        help="the UTC period a token quota renews every (default: month; total: never)")
    _add_database_arg(create)
    create.set_defaults(func=cmd_keys_create)

    update = actions.add_parser("update", help="change an active key's limits or tier (takes effect within seconds)")
    update.add_argument("key", help="key id (key_...) or the name of an active key")
    for flag, what in (("--rpm", "requests per minute"), ("--tpm", "tokens per minute"),
                       ("--token-quota", "tokens per quota period")):
        update.add_argument(flag, type=_limit_or_none, default=argparse.SUPPRESS, help=f"{what}, or none to lift it")
    update.add_argument("--quota-period", choices=QUOTA_PERIOD_CHOICES, default=argparse.SUPPRESS,
                        help="the UTC period the token quota renews every")
    update.add_argument("--models", default=argparse.SUPPRESS,
                        help="comma-separated models this key may use, or all")
    update.add_argument("--tier", default=argparse.SUPPRESS, help="the key's tier")
    _add_database_arg(update)
    update.set_defaults(func=cmd_keys_update)

    listing = actions.add_parser("list", help="list keys (never their secrets)")
    listing.add_argument("--all", action="store_true", help="include revoked keys")
    _add_database_arg(listing)
    listing.set_defaults(func=cmd_keys_list)

    revoke = actions.add_parser("revoke", help="revoke a key by id or name (takes effect within seconds)")
    revoke.add_argument("key", help="key id (key_...) or the name of an active key")
    _add_database_arg(revoke)
    revoke.set_defaults(func=cmd_keys_revoke)


def _add_database_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url", default=None,
        help="sqlite:///PATH or postgresql+psycopg://USER@HOST/DB (default: llmserve.db in the data directory, "
        "$LLMSERVE_DATA_DIR or $XDG_DATA_HOME/llmserve)",
    )


def cmd_keys_create(args: argparse.Namespace) -> int:
    models = args.models.split(",") if args.models is not None else None

    def create(store: KeyStore) -> None:
        key, secret = store.create(
            args.name, tier=args.tier, rpm=args.rpm, tpm=args.tpm, models=models, admin=args.admin,
            token_quota=args.token_quota, quota_period=args.quota_period,
        )
        _print_created(key, secret)

    return _run(args, create)


def cmd_keys_update(args: argparse.Namespace) -> int:
    changes = {name: getattr(args, name) for name in UPDATABLE if hasattr(args, name)}
    if "models" in changes:
        changes["models"] = None if changes["models"] == "all" else changes["models"].split(",")
    if not changes:
        return _fail("give at least one thing to change (--rpm, --tpm, --token-quota, --quota-period, --models, --tier)")

    def update(store: KeyStore) -> None:
        key = store.update(args.key, **changes)
        print(f"Updated key {key.id} named {key.name!r} ({_describe_limits(key)}).")

    return _run(args, update)


def _limit_or_none(value: str) -> int | None:
    if value.lower() == "none":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or none, got {value!r}") from None


def cmd_keys_list(args: argparse.Namespace) -> int:
    return _run(args, lambda store: _print_table(store.list(include_revoked=args.all), show_revoked=args.all))


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    return _run(args, lambda store: _print_revoked(store.revoke(args.key)))


def _run(args: argparse.Namespace, action: Callable[[KeyStore], None]) -> int:
    """Open the database and run `action`; for bad input or an unusable database print one line, exit 2."""
    from llmserve.platform.keys import KeyStore
    from llmserve.store.db import default_database_url, open_database

    try:
        database = open_database(args.database_url or default_database_url())
    except (ValueError, LLMServeError) as exc:
        return _fail(exc)
    try:
        action(KeyStore(database))
    except ValueError as exc:
        return _fail(exc)
    except KeyError as exc:
        return _fail(exc.args[0])
    finally:
        database.dispose()
    return 0


def _fail(message: object) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _describe_limits(key: ApiKey) -> str:
    models = ",".join(key.models) if key.models is not None else "all"
    return (
        f"tier {key.tier}, rpm {_limit(key.rpm)}, tpm {_limit(key.tpm)}, quota {_quota(key)}, models {models}"
        f"{', admin' if key.is_admin else ''}"
    )


def _quota(key: ApiKey) -> str:
    if key.token_quota is None:
        return "unlimited"
    return f"{key.token_quota} tokens {'in total' if key.quota_period == 'total' else f'per {key.quota_period}'}"


def _limit(value: int | None) -> str:
    return "unlimited" if value is None else str(value)


def _short_quota(key: ApiKey) -> str:
    return "unlimited" if key.token_quota is None else f"{key.token_quota}/{key.quota_period}"


def _print_created(key: ApiKey, secret: str) -> None:
    print(f"Created key {key.id} named {key.name!r} ({_describe_limits(key)}).")
    print(secret)
    print("This secret will not be shown again: store it now.")


def _print_revoked(key: ApiKey) -> None:
    print(f"Revoked key {key.id} named {key.name!r} at {key.revoked_at:%Y-%m-%d %H:%M:%S} UTC.")


def _print_table(keys: Sequence[ApiKey], show_revoked: bool) -> None:
    if not keys:
        print("No keys." if show_revoked else "No active keys (the server accepts requests without a key).")
        return
    header = ["ID", "NAME", "PREFIX", "TIER", "RPM", "TPM", "QUOTA", "MODELS", "ADMIN", "CREATED (UTC)"]
    if show_revoked:
        header.append("REVOKED (UTC)")
    rows = [header]
    for key in keys:
        row = [
            key.id, key.name, key.prefix + "...", key.tier, _limit(key.rpm), _limit(key.tpm), _short_quota(key),
            ",".join(key.models) if key.models is not None else "all",
            "yes" if key.is_admin else "no", f"{key.created_at:%Y-%m-%d %H:%M}",
        ]
        if show_revoked:
            row.append(f"{key.revoked_at:%Y-%m-%d %H:%M}" if key.revoked_at else "-")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
