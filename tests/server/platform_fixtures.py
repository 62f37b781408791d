"""A live server with the platform on (keys, rate limits, metering, conversations, stored responses, safety) over the
tiny model: one engine per test module, a fresh SQLite database and app per test.

The platform runs either in `llmserve serve`'s app ("direct") or in `llmserve gateway`'s, in front of
a replica app without a platform over the same engine ("gateway"): the same tests hold for both."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis
from fastapi import FastAPI
from sqlalchemy import func, select

from llmserve.engine.async_llm import AsyncLLM
from llmserve.engine.messages import EngineStats
from llmserve.gateway.app import build_gateway_app
from llmserve.platform.batches import BatchStore, FileStore
from llmserve.platform.chat_completions import StoredCompletions
from llmserve.platform.conversations import ConversationStore
from llmserve.platform.keys import ApiKey, KeyCache, KeyStore
from llmserve.platform.quota import QuotaLedger
from llmserve.platform.ratelimit import InProcessRateLimiter
from llmserve.platform.responses import ResponseStore
from llmserve.platform.usage import PriceTable, UsageRecorder
from llmserve.server.app import ModelSpec, build_app
from llmserve.server.gateway import Platform
from llmserve.store.db import Database, open_database
from llmserve.store.schema import UsageRecordRow
from tests.server.conftest import idle_stats, start_server, tiny_engine_running

MODEL = "tiny-llama"
MODES = ("direct", "gateway")
REDIS_URL = os.environ.get("LLMSERVE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def redis_or_skip() -> redis.Redis:
    """A client of the test Redis, or the test skipped when it is unreachable."""
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.skip(f"Redis at {REDIS_URL} is unreachable: {exc}")
    return client


class FrozenClock:
    """A clock that moves only when told (key-cache expiry and rate-limit refill without sleeping)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class PlatformServer:
    base_url: str
    engine: AsyncLLM
    platform: Platform
    database: Database
    keys: KeyStore
    clock: FrozenClock
    server: object = field(repr=False, default=None)
    app: FastAPI | None = field(repr=False, default=None)
    loop: asyncio.AbstractEventLoop | None = field(repr=False, default=None)  # the engine client's (the replica's)

    def idle_stats(self) -> EngineStats:
        """Wait (without sleeping) until the engine has nothing left to run; its fresh stats."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(idle_stats(self.engine), self.loop).result(timeout=120)

    def client(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=60)

    def new_key(self, name: str, **kwargs) -> tuple[ApiKey, str]:
        return self.keys.create(name, **kwargs)

    def usage_rows(self) -> list[UsageRecordRow]:
        assert self.platform.usage is not None
        self.platform.usage.flush()
        with self.database.session() as session:
            return list(session.scalars(select(UsageRecordRow).order_by(UsageRecordRow.created_at)))

    def wait_for_usage_rows(self, count: int, timeout: float = 30.0) -> list[UsageRecordRow]:
        """Poll (flushing) until `count` records are stored; a request's record is written when its
        handler has unwound, which for a disconnected stream is after the client saw the end."""
        deadline = time.monotonic() + timeout
        while True:
            rows = self.usage_rows()
            if len(rows) >= count or time.monotonic() > deadline:
                return rows
            time.sleep(0.02)

    def wait_until(self, condition: Callable[[], bool], timeout: float = 30.0) -> bool:
        """Poll `condition` until it holds (True) or `timeout` passes (False)."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def count_usage_rows(self) -> int:
        with self.database.session() as session:
            return session.scalar(select(func.count()).select_from(UsageRecordRow)) or 0


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir: Path) -> Iterator[AsyncLLM]:
    with tiny_engine_running(tiny_llama_dir, num_kv_blocks=1024, max_num_batched_tokens=256) as engine:
        yield engine


def serve_platform(
    engine: AsyncLLM,
    directory: Path,
    *,
    models: list[ModelSpec] | None = None,
    aliases: dict | None = None,
    prices: PriceTable | None = None,
    mode: str = "direct",
    tier_priorities: dict[str, int] | None = None,
    batch_concurrency: int = 8,
    max_file_bytes: int = 1 << 20,
    **app_options: object,
) -> Iterator[PlatformServer]:
    """The platform over a fresh SQLite database, in `mode` ("direct": `llmserve serve`'s app;
    "gateway": a gateway in front of a replica app without a platform)."""
    database = open_database(f"sqlite:///{directory / 'platform.db'}")
    clock = FrozenClock()
    keys = KeyStore(database)
    usage = UsageRecorder(database, flush_interval=0.2)
    platform = Platform(
        keys=KeyCache(keys, ttl_seconds=2.0, clock=clock),
        limiter=InProcessRateLimiter(clock=clock),
        quotas=QuotaLedger(database, usage, clock=clock),
        usage=usage,
        conversations=ConversationStore(database),
        responses=ResponseStore(database),
        completions=StoredCompletions(database),
        batches=BatchStore(database, FileStore(database, max_file_bytes)),
        batch_concurrency=batch_concurrency,
        prices=prices or PriceTable(),
        database=database,
        tier_priorities=tier_priorities or {},
    )
    if mode == "gateway":
        yield from _behind_gateway(engine, platform, database, keys, clock, models, aliases, **app_options)
        return
    if models is None:
        app = build_app(engine, MODEL, platform=platform, aliases=aliases, **app_options)
    else:
        app = build_app(models=models, platform=platform, aliases=aliases, **app_options)
    server, thread, base_url, loop = start_server(app)
    try:
        yield PlatformServer(base_url, engine, platform, database, keys, clock, server, app, loop)
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _behind_gateway(
    engine: AsyncLLM, platform: Platform, database: Database, keys: KeyStore, clock: FrozenClock,
    models: list[ModelSpec] | None, aliases: dict | None, **gateway_options: object,
) -> Iterator[PlatformServer]:
    """The replica: the models without a platform; the gateway: a pool per model, the aliases, the platform."""
    replica = build_app(engine, MODEL) if models is None else build_app(models=models)
    replica_server, replica_thread, replica_url, replica_loop = start_server(replica)
    names = [MODEL] if models is None else [spec.name for spec in models]
    gateway = build_gateway_app(
        {name: [replica_url] for name in names}, platform=platform, aliases=aliases, **gateway_options
    )
    server, thread, base_url, _ = start_server(gateway)
    try:
        yield PlatformServer(base_url, engine, platform, database, keys, clock, server, gateway, replica_loop)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        replica_server.should_exit = True
        replica_thread.join(timeout=30)


def chat_body(content: str = "Hello there", max_tokens: int = 4, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}


def sse_events(lines: Iterator[str], stop_after: int | None = None) -> list[tuple[int, str]]:
    """(id, data) of a response's SSE events, the first `stop_after` of them (None: all)."""
    events, event_id = [], -1
    for line in lines:
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            events.append((event_id, line[6:]))
            if len(events) == stop_after:
                break
    return events
