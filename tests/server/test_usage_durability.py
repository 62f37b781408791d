"""Usage metering through a crash and past the shutdown timeout, with real server processes: after a
`kill -9` under load (of `llmserve serve`, or of `llmserve gateway` in front of a replica), every
response a client received in full is in the usage table and the requests that were running are
recorded as interrupted; a shutdown that runs out of time ends each
open stream with an error event and records it as aborted by the server."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from llmserve.server.gateway import PROGRESS_EVERY_TOKENS
from llmserve.store.db import open_database
from llmserve.store.schema import UsageRecordRow
from tests.server.test_platform_processes import MODES, replica_for, serve
from tests.store.fixtures import postgres_schema, postgres_unreachable_reason, postgres_url

LONG_STREAMS = 4  # running at the kill
LONG_MAX_TOKENS = 2000  # far more than they get to generate before the kill
COMPLETED_BEFORE_KILL = 16
SERVE_ARGS = ("--max-model-len", "2048", "--num-kv-blocks", "700")


def stored_rows(database_url: str) -> dict[str, UsageRecordRow]:
    database = open_database(database_url)
    try:
        with database.session() as session:
            return {row.request_id: row for row in session.scalars(select(UsageRecordRow))}
    finally:
        database.dispose()


@dataclass
class Load:
    """What the client saw: responses received in full (id -> completion tokens) and the long streams'
    ids with how many chunks each had received."""

    completed: dict[str, int] = field(default_factory=dict)
    long_chunks: dict[str, int] = field(default_factory=dict)


def _chunk_id(line: str) -> str:
    return json.loads(line[len("data: "):])["id"]


async def _long_stream(client: httpx.AsyncClient, i: int, load: Load, ready: asyncio.Event) -> None:
    body = {"prompt": f"Long {i}", "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                request_id = _chunk_id(line)
                load.long_chunks[request_id] = load.long_chunks.get(request_id, 0) + 1
                if len(load.long_chunks) == LONG_STREAMS and min(load.long_chunks.values()) >= 2 * PROGRESS_EVERY_TOKENS:
                    ready.set()


async def _short_requests(client: httpx.AsyncClient, worker: int, load: Load) -> None:
    for n in range(1_000_000):
        content = [{"role": "user", "content": f"Hi {worker}.{n}"}]
        if n % 2:
            body = {"messages": content, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                request_id, tokens = None, None
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[len("data: "):])
                        request_id = chunk["id"]
                        tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                    elif line == "data: [DONE]":
                        assert request_id is not None and tokens is not None
                        load.completed[request_id] = tokens
        else:
            response = await client.post("/v1/completions", json={"prompt": f"Hi {worker}.{n}", "max_tokens": 8})
            assert response.status_code == 200
            load.completed[response.json()["id"]] = response.json()["usage"]["completion_tokens"]


async def _until_loaded(ready: asyncio.Event, load: Load) -> None:
    await ready.wait()
    while len(load.completed) < COMPLETED_BEFORE_KILL:
        await asyncio.sleep(0.01)  # polling the client's own progress, not waiting on the server


async def _load_then_kill(proc: subprocess.Popen, base_url: str) -> Load:
    """Long streams plus a stream of short requests; `kill -9` the server mid-load."""
    load = Load()
    ready = asyncio.Event()
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=httpx.Limits(max_connections=32)) as client:
        tasks = [asyncio.ensure_future(_long_stream(client, i, load, ready)) for i in range(LONG_STREAMS)]
        tasks += [asyncio.ensure_future(_short_requests(client, w, load)) for w in range(6)]
        loaded = asyncio.ensure_future(_until_loaded(ready, load))
        await asyncio.wait([loaded, *tasks], timeout=120, return_when=asyncio.FIRST_COMPLETED)
        assert loaded.done(), [t.exception() for t in tasks if t.done()]  # no request failed or ended early
        proc.kill()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, httpx.TransportError) for r in results), results  # every one was cut
    return load


def _killed_under_load_then_restarted(model_dir: Path, database_url: str, journal: Path, mode: str) -> None:
    """`kill -9` of the server, or of the gateway (its replica goes on, and aborts what it ran for it)."""
    with replica_for(mode, model_dir, *SERVE_ARGS) as replica_url:
        platform_args = (*SERVE_ARGS, "--usage-journal", str(journal)) if replica_url is None else (
            "--usage-journal", str(journal))
        with serve(model_dir, database_url, *platform_args, replica_url=replica_url) as (proc, base_url):
            load = asyncio.run(_load_then_kill(proc, base_url))
            proc.wait(timeout=30)
        with serve(model_dir, database_url, *platform_args, replica_url=replica_url):
            rows = stored_rows(database_url)  # the restart wrote the journal to the database before listening

    assert len(load.completed) >= COMPLETED_BEFORE_KILL
    for request_id, completion_tokens in load.completed.items():
        row = rows.get(request_id)
        assert row is not None, f"{request_id} was received in full but is not in the usage table"
        assert (row.status, row.completion_tokens) == ("completed", completion_tokens)
    for request_id in load.long_chunks:
        row = rows[request_id]
        assert row.status == "interrupted" and row.prompt_tokens > 0
        assert PROGRESS_EVERY_TOKENS <= row.completion_tokens < LONG_MAX_TOKENS
    assert {row.status for row in rows.values()} <= {"completed", "interrupted"}


# The two stores and the two places that meter (the server; the gateway in front of a replica) each once: the
# journal and its replay are the same code whichever store is behind them.
@pytest.mark.parametrize("mode", ["direct"])
def test_kill_9_under_load_loses_no_usage_on_sqlite(tiny_llama_dir: Path, tmp_path: Path, mode: str) -> None:
    _killed_under_load_then_restarted(
        tiny_llama_dir, f"sqlite:///{tmp_path / 'usage.db'}", tmp_path / "journal", mode
    )


@pytest.mark.parametrize("mode", ["gateway"])
def test_kill_9_under_load_loses_no_usage_on_postgresql(tiny_llama_dir: Path, tmp_path: Path, mode: str) -> None:
    reason = postgres_unreachable_reason()
    if reason:
        pytest.skip(reason)
    with postgres_schema() as schema:
        _killed_under_load_then_restarted(tiny_llama_dir, postgres_url(schema), tmp_path / "journal", mode)


async def _streams_through_a_timed_out_shutdown(proc: subprocess.Popen, base_url: str) -> list[list[str]]:
    """Long streams; SIGTERM once each is running; each stream's data lines to its end."""
    running = asyncio.Semaphore(0)

    async def one(i: int) -> list[str]:
        body = {"messages": [{"role": "user", "content": f"Long {i}"}], "max_tokens": LONG_MAX_TOKENS,
                "ignore_eos": True, "stream": True}
        lines: list[str] = []
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        if len(lines) == 1:
                            running.release()
        return lines

    tasks = [asyncio.ensure_future(one(i)) for i in range(3)]
    for _ in tasks:
        await running.acquire()
    proc.send_signal(signal.SIGTERM)
    return list(await asyncio.gather(*tasks))


@pytest.mark.parametrize("mode", MODES)
def test_a_shutdown_past_its_timeout_ends_streams_with_an_error_and_meters_them(
    tiny_llama_dir: Path, tmp_path: Path, mode: str
) -> None:
    """SIGTERM to the server, or to the gateway (its replica goes on, and aborts what it ran for it)."""
    database_url = f"sqlite:///{tmp_path / 'usage.db'}"
    with replica_for(mode, tiny_llama_dir, *SERVE_ARGS) as replica_url:
        engine_args = SERVE_ARGS if replica_url is None else ()
        with serve(tiny_llama_dir, database_url, *engine_args, "--shutdown-timeout", "0.5",
                   replica_url=replica_url) as (proc, base_url):
            streams = asyncio.run(_streams_through_a_timed_out_shutdown(proc, base_url))
            assert proc.wait(timeout=60) == 0
    rows = stored_rows(database_url)
    for lines in streams:
        *chunks, error_line, done = lines
        assert done == "data: [DONE]"
        error = json.loads(error_line[len("data: "):])["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "shutting_down"
        row = rows[_chunk_id(chunks[0])]
        assert row.status == "aborted_by_server"
        assert 0 < row.completion_tokens < LONG_MAX_TOKENS
    assert len(rows) == len(streams)
