"""API keys: create, list and revoke them, look a secret up, and cache those lookups for the server.

A secret is `sk-llms-` followed by 43 url-safe characters (256 random bits). Only its sha256 is
stored: with that much entropy a plain hash cannot be brute-forced, and it keeps lookups to one
indexed equality query.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError

from llmserve.platform.quota import QUOTA_PERIODS
from llmserve.store.db import Database
from llmserve.store.schema import NAME_LENGTH, ApiKeyRow, utcnow

SECRET_PREFIX = "sk-llms-"
_SECRET_RANDOM_BYTES = 32
_SECRET_PATTERN = re.compile(r"sk-llms-[A-Za-z0-9_-]{43}")
DISPLAY_PREFIX_LENGTH = len(SECRET_PREFIX) + 4
TIER_LENGTH = 64


LIMIT_MAX = {"rpm": 2**31 - 1, "tpm": 2**31 - 1, "token_quota": 2**63 - 1}  # their columns' ranges
UPDATABLE = ("rpm", "tpm", "models", "token_quota", "quota_period", "tier")
STATIC_KEY_ID = "api-key"  # the id `--api-key`'s key meters and owns conversations under


def static_api_key(created_at: datetime) -> ApiKey:
    """The key of `--api-key` (vLLM's: one secret given at start, not stored): every model, no limits, an
    admin's (the operator's own)."""
    return ApiKey(id=STATIC_KEY_ID, name="--api-key", prefix="", tier="default", rpm=None, tpm=None, models=None,
                  is_admin=True, created_at=created_at, revoked_at=None)


def generate_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(_SECRET_RANDOM_BYTES)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def looks_like_key(secret: object) -> bool:
    """True when `secret` has the shape of an llmserve key; anything else is rejected without a query."""
    return isinstance(secret, str) and _SECRET_PATTERN.fullmatch(secret) is not None


@dataclass(frozen=True)
class ApiKey:
    """An API key as the server sees it (never the secret)."""

    id: str
    name: str
    prefix: str
    tier: str
    rpm: int | None  # requests per minute; None: unlimited
    tpm: int | None  # tokens per minute; None: unlimited
    models: tuple[str, ...] | None  # None: every model
    is_admin: bool
    created_at: datetime
    revoked_at: datetime | None
    token_quota: int | None = None  # tokens per quota_period (platform.quota); None: unlimited
    quota_period: str | None = None  # day, week, month or total (UTC calendar periods)

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    def allows_model(self, model: str) -> bool:
        return self.models is None or model in self.models

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "prefix": self.prefix,
            "tier": self.tier,
            "rpm": self.rpm,
            "tpm": self.tpm,
            "token_quota": self.token_quota,
            "quota_period": self.quota_period,
            "models": list(self.models) if self.models is not None else None,
            "is_admin": self.is_admin,
            "created_at": self.created_at.isoformat(),
            "revoked_at": self.revoked_at.isoformat() if self.revoked_at else None,
        }


def _to_api_key(row: ApiKeyRow) -> ApiKey:
    return ApiKey(
        id=row.id,
        name=row.name,
        prefix=row.prefix,
        tier=row.tier,
        rpm=row.rpm,
        tpm=row.tpm,
        models=tuple(row.models) if row.models is not None else None,
        is_admin=row.is_admin,
        created_at=row.created_at,
        revoked_at=row.revoked_at,
        token_quota=row.token_quota,
        quota_period=row.quota_period if row.token_quota is not None else None,
    )


def _checked_name(name: str) -> str:
    name = name.strip() if isinstance(name, str) else ""
    if not name:
        raise ValueError("a key needs a non-empty name")
    if len(name) > NAME_LENGTH:
        raise ValueError(f"key name is longer than {NAME_LENGTH} characters")
    return name


def _checked_tier(tier: str) -> str:
    tier = tier.strip() if isinstance(tier, str) else ""
    if not tier or len(tier) > TIER_LENGTH:
        raise ValueError(f"tier must be a non-empty name of at most {TIER_LENGTH} characters")
    return tier


def _checked_limit(flag: str, value: int | None) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{flag} must be a positive integer, got {value!r}")
    if value > LIMIT_MAX[flag]:
        raise ValueError(f"{flag} must be at most {LIMIT_MAX[flag]}, got {value}")
    return value


def _checked_quota(token_quota: int | None, quota_period: str | None) -> tuple[int | None, str | None]:
    """A quota and its period; a quota given alone is per month."""
    token_quota = _checked_limit("token_quota", token_quota)
    if token_quota is None:
        if quota_period is not None:
            raise ValueError("quota_period needs a token_quota")
        return None, None
    period = quota_period or "month"
    if period not in QUOTA_PERIODS:
        raise ValueError(f"quota_period must be one of {', '.join(QUOTA_PERIODS)}, got {quota_period!r}")
    return token_quota, period


def _checked_models(models: Iterable[str] | None) -> list[str] | None:
    if models is None:
        return None
    names = [m.strip() if isinstance(m, str) else "" for m in models]
    if not names or not all(names):
        raise ValueError("models must be a non-empty list of non-empty model names (omit it for every model)")
    return list(dict.fromkeys(names))  # de-duplicated, order kept


class KeyStore:
    """API keys in the database. Every method is one short transaction; safe from any thread."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def create(
        self,
        name: str,
        tier: str = "default",
        rpm: int | None = None,
        tpm: int | None = None,
        models: Iterable[str] | None = None,
        admin: bool = False,
        token_quota: int | None = None,
        quota_period: str | None = None,
    ) -> tuple[ApiKey, str]:
        """Create a key; returns it and its secret, which is not stored and cannot be shown again.

        Raises ValueError for bad input or when an active key already has this name.
        """
        name = _checked_name(name)
        token_quota, quota_period = _checked_quota(token_quota, quota_period)
        row = ApiKeyRow(
            id="key_" + secrets.token_hex(8),
            name=name,
            tier=_checked_tier(tier),
            rpm=_checked_limit("rpm", rpm),
            tpm=_checked_limit("tpm", tpm),
            models=_checked_models(models),
            is_admin=bool(admin),
            created_at=utcnow(),
            token_quota=token_quota,
            quota_period=quota_period,
        )
        secret = generate_secret()
        row.prefix = secret[:DISPLAY_PREFIX_LENGTH]
        row.secret_hash = hash_secret(secret)
        try:
            with self._db.session(write=True) as session:
                if self._active_by_name(session, name) is not None:
                    raise ValueError(f"an active key named {name!r} already exists")
                session.add(row)
        except IntegrityError as exc:  # a concurrent create took the name first
            raise ValueError(f"an active key named {name!r} already exists") from exc
        return _to_api_key(row), secret

    def list(self, include_revoked: bool = False) -> list[ApiKey]:
        """Keys oldest first; revoked ones only when asked."""
        query = select(ApiKeyRow).order_by(ApiKeyRow.created_at, ApiKeyRow.id)
        if not include_revoked:
            query = query.where(ApiKeyRow.revoked_at.is_(None))
        with self._db.session() as session:
            return [_to_api_key(row) for row in session.scalars(query)]

    def update(self, id_or_name: str, **limits: Any) -> ApiKey:
        """Change an active key's limits or tier, named as `create`'s (UPDATABLE; None lifts a limit); the
        rest are kept. Takes effect within the servers' key-cache ttl.

        Raises KeyError when there is no such active key, ValueError for bad input.
        """
        unknown = set(limits) - set(UPDATABLE)
        if unknown:
            raise ValueError(f"cannot update {', '.join(sorted(unknown))} (only {', '.join(UPDATABLE)})")
        with self._db.session(write=True) as session:
            row = session.get(ApiKeyRow, id_or_name) or self._active_by_name(session, id_or_name)
            if row is None or row.revoked_at is not None:
                raise KeyError(f"no active key with id or name {id_or_name!r}")
            for flag in ("rpm", "tpm"):
                if flag in limits:
                    setattr(row, flag, _checked_limit(flag, limits[flag]))
            if "models" in limits:
                row.models = _checked_models(limits["models"])
            if "tier" in limits:
                row.tier = _checked_tier(limits["tier"])
            if "token_quota" in limits or "quota_period" in limits:
                quota = limits.get("token_quota", row.token_quota)
                period = limits.get("quota_period", row.quota_period if quota is not None else None)
                row.token_quota, row.quota_period = _checked_quota(quota, period)
            return _to_api_key(row)

    def revoke(self, id_or_name: str) -> ApiKey:
        """Revoke the key with this id, or the active key with this name. Revoking twice is harmless.

        Raises KeyError when there is no such key.
        """
        with self._db.session(write=True) as session:
            row = session.get(ApiKeyRow, id_or_name) or self._active_by_name(session, id_or_name)
            if row is None:
                raise KeyError(f"no key with id or active name {id_or_name!r}")
            if row.revoked_at is None:
                row.revoked_at = utcnow()
            return _to_api_key(row)

    def get_active(self, key_id: str) -> ApiKey | None:
        """The key with this id if it is active (a batch runs as the key that made it, while it is)."""
        with self._db.session() as session:
            row = session.get(ApiKeyRow, key_id)
            return _to_api_key(row) if row is not None and row.revoked_at is None else None

    def has_active_keys(self) -> bool:
        query = select(func.count()).select_from(ApiKeyRow).where(ApiKeyRow.revoked_at.is_(None))
        with self._db.session() as session:
            return session.scalar(query) > 0

    def lookup(self, secret: str) -> ApiKey | None:
        """The active key with this secret, or None (malformed, unknown or revoked)."""
        if not looks_like_key(secret):
            return None
        return self.lookup_hash(hash_secret(secret))

    def lookup_hash(self, secret_hash: str) -> ApiKey | None:
        query = select(ApiKeyRow).where(ApiKeyRow.secret_hash == secret_hash, ApiKeyRow.revoked_at.is_(None))
        with self._db.session() as session:
            row = session.scalars(query).first()
            return _to_api_key(row) if row is not None else None

    @staticmethod
    def _active_by_name(session: Any, name: str) -> ApiKeyRow | None:
        query = select(ApiKeyRow).where(ApiKeyRow.name == name, ApiKeyRow.revoked_at.is_(None))
        return session.scalars(query).first()


@dataclass
class _CacheEntry:
    value: Any
    expires_at: float


class KeyCache:
    """Answers authentication from memory for up to `ttl_seconds`, so a request costs no query.

    Unknown and revoked secrets are cached for `negative_ttl_seconds` (default: the same ttl), so a
    client hammering with a bad key cannot turn each request into a query either. Concurrent
    lookups of one secret share one query. Queries run in a worker thread via `asyncio.to_thread`.
    A revoked or newly created key takes effect within the ttl. Database errors propagate (and
    are not cached). Use one KeyCache per event loop.
    """

    _HAS_KEYS = "has_active_keys"

    def __init__(
        self,
        store: KeyStore,
        ttl_seconds: float = 2.0,
        negative_ttl_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_entries: int = 10_000,
    ) -> None:
        self._store = store
        self._ttl = ttl_seconds
        self._negative_ttl = ttl_seconds if negative_ttl_seconds is None else negative_ttl_seconds
        self._clock = clock
        self._max_entries = max_entries
        self._entries: OrderedDict[str, _CacheEntry] = OrderedDict()
        self._in_flight: dict[str, asyncio.Future[Any]] = {}
        self.queries = 0  # database lookups made, for tests and metrics

    async def authenticate(self, secret: str | None) -> ApiKey | None:
        """The active key for this secret, or None for a missing, malformed, unknown or revoked one."""
        if not looks_like_key(secret):
            return None
        digest = hash_secret(secret)
        return await self._cached(digest, lambda: self._store.lookup_hash(digest))

    async def has_active_keys(self) -> bool:
        """Whether any key is active (no keys: the server runs open, in local mode)."""
        return await self._cached(self._HAS_KEYS, self._store.has_active_keys)

    async def get_active(self, key_id: str) -> ApiKey | None:
        """The active key with this id, or None (revoked or unknown); cached as a secret's lookup is."""
        return await self._cached(f"id:{key_id}", lambda: self._store.get_active(key_id))

    def invalidate(self) -> None:
        """Forget everything cached (e.g. after revoking a key in this process)."""
        self._entries.clear()

    async def _cached(self, cache_key: str, load: Callable[[], Any]) -> Any:
        entry = self._entries.get(cache_key)
        if entry is not None and entry.expires_at > self._clock():
            return entry.value
        future = self._in_flight.get(cache_key)
        if future is None:
            future = asyncio.ensure_future(self._load(cache_key, load))
            self._in_flight[cache_key] = future
            future.add_done_callback(lambda _: self._in_flight.pop(cache_key, None))
        # Shielded: one waiter giving up (client gone) must not cancel the query for the others.
        return await asyncio.shield(future)

    async def _load(self, cache_key: str, load: Callable[[], Any]) -> Any:
        self.queries += 1
        value = await asyncio.to_thread(load)
        ttl = self._ttl if value else self._negative_ttl
        self._entries[cache_key] = _CacheEntry(value, self._clock() + ttl)
        self._entries.move_to_end(cache_key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
        return value
