"""API keys: creation and validation, hashed storage, lookup, revocation, and the server's lookup cache."""

from __future__ import annotations

import asyncio
import hashlib
from datetime import datetime

import pytest
from sqlalchemy import select

from llmserve.platform.keys import ApiKey, KeyCache, KeyStore, looks_like_key
from llmserve.store.db import Database
from llmserve.store.schema import ApiKeyRow
from tests.store.fixtures import db_fixture, recorded_statements, shared_db_fixture  # noqa: F401


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_create_returns_a_key_and_a_secret_that_looks_up_to_it(db: Database) -> None:
    store = KeyStore(db)
    key, secret = store.create("ci", tier="gold", rpm=60, tpm=10_000, models=["a", "b", "a"], admin=True)

    assert looks_like_key(secret) and secret.startswith("sk-llms-") and len(secret) == 51
    assert key.id.startswith("key_") and key.prefix == secret[:12]
    assert (key.name, key.tier, key.rpm, key.tpm, key.models, key.is_admin) == ("ci", "gold", 60, 10_000, ("a", "b"), True)
    assert key.revoked_at is None and key.created_at.tzinfo is not None
    assert store.lookup(secret) == key


def test_only_the_hash_of_the_secret_is_stored(db: Database) -> None:
    _, secret = KeyStore(db).create("ci")
    with db.session() as session:
        row = session.scalars(select(ApiKeyRow)).one()
        values = [str(getattr(row, column.key)) for column in ApiKeyRow.__table__.columns]
    assert row.secret_hash == hashlib.sha256(secret.encode()).hexdigest()
    assert not any(secret in value for value in values)


def test_defaults_are_unlimited_and_all_models(db: Database) -> None:
    key, _ = KeyStore(db).create("plain")
    assert (key.tier, key.rpm, key.tpm, key.models, key.is_admin) == ("default", None, None, None, False)
    assert key.allows_model("anything")


def test_allows_model_follows_the_model_list(db: Database) -> None:
    key, _ = KeyStore(db).create("limited", models=["tiny-llama"])
    assert key.allows_model("tiny-llama")
    assert not key.allows_model("other")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rpm": 0}, "rpm must be a positive integer"),
        ({"rpm": -5}, "rpm must be a positive integer"),
        ({"tpm": 1.5}, "tpm must be a positive integer"),
        ({"tpm": True}, "tpm must be a positive integer"),
        ({"name": "   "}, "non-empty name"),
        ({"name": "x" * 201}, "longer than 200"),
        ({"models": []}, "non-empty list"),
        ({"models": ["a", " "]}, "non-empty list"),
        ({"tier": ""}, "tier must be"),
    ],
)
def test_bad_input_is_refused(db: Database, kwargs: dict, message: str) -> None:
    store = KeyStore(db)
    with pytest.raises(ValueError, match=message):
        store.create(**{"name": "k", **kwargs})
    assert store.list(include_revoked=True) == []


def test_an_active_name_is_unique_but_a_revoked_name_can_be_reused(db: Database) -> None:
    store = KeyStore(db)
    first, _ = store.create("team")
    with pytest.raises(ValueError, match="an active key named 'team' already exists"):
        store.create("team")
    store.revoke("team")
    second, _ = store.create("team")
    assert second.id != first.id
    assert [k.id for k in store.list(include_revoked=True)] == [first.id, second.id]


def test_revoke_by_id_or_name_hides_the_key_from_lookup(db: Database) -> None:
    store = KeyStore(db)
    by_id, secret_1 = store.create("one")
    _, secret_2 = store.create("two")

    revoked = store.revoke(by_id.id)
    assert revoked.id == by_id.id and isinstance(revoked.revoked_at, datetime)
    assert store.lookup(secret_1) is None
    assert store.revoke("two").name == "two"
    assert store.lookup(secret_2) is None
    assert store.list() == []
    assert [k.name for k in store.list(include_revoked=True)] == ["one", "two"]


def test_revoking_twice_keeps_the_first_revocation_time(db: Database) -> None:
    store = KeyStore(db)
    key, _ = store.create("one")
    first = store.revoke(key.id)
    assert store.revoke(key.id).revoked_at == first.revoked_at


def test_revoking_an_unknown_key_raises_key_error(db: Database) -> None:
    with pytest.raises(KeyError, match="no key with id or active name 'ghost'"):
        KeyStore(db).revoke("ghost")


def test_has_active_keys_follows_create_and_revoke(db: Database) -> None:
    store = KeyStore(db)
    assert store.has_active_keys() is False
    key, _ = store.create("one")
    assert store.has_active_keys() is True
    store.revoke(key.id)
    assert store.has_active_keys() is False


MALFORMED_KEYS = [
    None, "", "Bearer x", "sk-llms-short", "sk-llms-" + "a" * 44, "sk-other-" + "a" * 43, "sk-llms-" + "a" * 42 + "!",
]


def test_malformed_keys_are_rejected_without_a_query(db: Database) -> None:
    store = KeyStore(db)
    with recorded_statements(db.engine) as statements:
        for candidate in MALFORMED_KEYS:
            assert not looks_like_key(candidate)
            assert store.lookup(candidate) is None
    assert statements == []


def test_an_unknown_well_formed_key_is_not_found(db: Database) -> None:
    assert KeyStore(db).lookup("sk-llms-" + "A" * 43) is None


def test_cache_answers_from_memory_until_the_ttl_and_then_sees_revocation(db: Database) -> None:
    store = KeyStore(db)
    key, secret = store.create("cached")
    clock = FakeClock()
    cache = KeyCache(store, ttl_seconds=2.0, clock=clock)

    async def scenario() -> list[ApiKey | None]:
        results = [await cache.authenticate(secret)]
        store.revoke(key.id)
        clock.now += 1.9
        results.append(await cache.authenticate(secret))  # still cached
        clock.now += 0.2
        results.append(await cache.authenticate(secret))  # ttl passed: revocation visible
        return results

    assert asyncio.run(scenario()) == [key, key, None]
    assert cache.queries == 2


def test_cache_keeps_negative_answers_briefly(db: Database) -> None:
    store = KeyStore(db)
    clock = FakeClock()
    cache = KeyCache(store, ttl_seconds=5.0, negative_ttl_seconds=1.0, clock=clock)
    unknown = "sk-llms-" + "B" * 43

    async def scenario() -> list[ApiKey | None]:
        results = [await cache.authenticate(unknown) for _ in range(3)]
        clock.now += 1.5
        results.append(await cache.authenticate(unknown))
        return results

    assert asyncio.run(scenario()) == [None, None, None, None]
    assert cache.queries == 2


def test_cache_rejects_malformed_keys_without_a_query(db: Database) -> None:
    cache = KeyCache(KeyStore(db), clock=FakeClock())
    assert asyncio.run(cache.authenticate("not-a-key")) is None
    assert asyncio.run(cache.authenticate(None)) is None
    assert cache.queries == 0


def test_concurrent_lookups_of_one_secret_share_one_query(db: Database) -> None:
    store = KeyStore(db)
    key, secret = store.create("busy")
    cache = KeyCache(store, clock=FakeClock())

    async def scenario() -> list[ApiKey | None]:
        return await asyncio.gather(*(cache.authenticate(secret) for _ in range(20)))

    assert asyncio.run(scenario()) == [key] * 20
    assert cache.queries == 1


def test_cached_has_active_keys_turns_true_within_the_ttl_of_a_new_key(db: Database) -> None:
    store = KeyStore(db)
    clock = FakeClock()
    cache = KeyCache(store, ttl_seconds=2.0, clock=clock)

    async def scenario() -> list[bool]:
        results = [await cache.has_active_keys()]
        store.create("first")
        results.append(await cache.has_active_keys())
        clock.now += 2.1
        results.append(await cache.has_active_keys())
        return results

    assert asyncio.run(scenario()) == [False, False, True]
    assert cache.queries == 2


def test_invalidate_forgets_cached_answers(db: Database) -> None:
    store = KeyStore(db)
    key, secret = store.create("gone")
    cache = KeyCache(store, ttl_seconds=60.0, clock=FakeClock())

    async def scenario() -> list[ApiKey | None]:
        first = await cache.authenticate(secret)
        store.revoke(key.id)
        cache.invalidate()
        return [first, await cache.authenticate(secret)]

    assert asyncio.run(scenario()) == [key, None]


def test_cache_holds_at_most_max_entries(db: Database) -> None:
    store = KeyStore(db)
    key, secret = store.create("kept")
    cache = KeyCache(store, ttl_seconds=60.0, clock=FakeClock(), max_entries=3)

    async def scenario() -> None:
        await cache.authenticate(secret)
        for letter in "CDE":
            await cache.authenticate("sk-llms-" + letter * 43)
        await cache.authenticate(secret)  # evicted as the oldest: queried again

    asyncio.run(scenario())
    assert cache.queries == 5
