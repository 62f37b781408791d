"""The platform across real server processes, in `llmserve serve` and in `llmserve gateway` (in front of
`llmserve serve --no-platform` replicas) alike: two of them sharing Redis enforce one token limit, a
SIGTERM in the middle of load loses no usage record, and named models, aliases and a config file."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from llmserve.platform.keys import KeyStore
from llmserve.store.db import open_database
from llmserve.store.schema import UsageRecordRow
from tests.server.platform_fixtures import MODES, REDIS_URL, redis_or_skip, sse_events
from tests.server.test_serve_cli import _Lines
from tests.store.fixtures import postgres_schema, postgres_url

MODEL = "tiny"  # the gateway's pool, and its replica's --served-model-name
ENGINE_ARGS = ("--dtype", "float32", "--num-kv-blocks", "256", "--max-model-len", "512")


@contextmanager
def _running(command: list[str], pattern: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """A process and the URL its output announces (matched by `pattern`)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        yield proc, _Lines(proc).wait_for(pattern).group(1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextmanager
def replica(model_dir: Path, *engine_args: str) -> Iterator[str]:
    """`llmserve serve --no-platform`: what a gateway sends its requests to."""
    command = [sys.executable, "-m", "llmserve.cli", "serve", "--model", str(model_dir), "--served-model-name",
               MODEL, "--no-platform", "--port", "0", *ENGINE_ARGS, *engine_args]
    with _running(command, r"serving \S+ at (http://\S+)/v1") as (_, url):
        yield url


@contextmanager
def serve(
    model_dir: Path, database_url: str, *extra: str, replica_url: str | None = None
) -> Iterator[tuple[subprocess.Popen, str]]:
    """The platform over HTTP: `llmserve serve` (`extra`: its flags), or with `replica_url`, `llmserve
    gateway` in front of that replica (`extra`: platform flags only)."""
    if replica_url is None:
        command = [sys.executable, "-m", "llmserve.cli", "serve", "--model", str(model_dir), "--port", "0",
                   *ENGINE_ARGS, "--database-url", database_url, *extra]
        pattern = r"serving \S+ at (http://\S+)/v1"
    else:
        command = [sys.executable, "-m", "llmserve.cli", "gateway", "--pool", f"{MODEL}={replica_url}", "--port",
                   "0", "--database-url", database_url, *extra]
        pattern = r"llmserve: gateway at (http://\S+)/v1"
    with _running(command, pattern) as running:
        yield running


@contextmanager
def replica_for(mode: str, model_dir: Path, *engine_args: str) -> Iterator[str | None]:
    """The replica a gateway stands in front of ("gateway"), or none ("direct": the server runs its engine)."""
    if mode == "direct":
        yield None
        return
    with replica(model_dir, *engine_args) as url:
        yield url


@pytest.mark.parametrize("mode", MODES)
def test_two_replicas_sharing_redis_share_one_token_limit_and_their_streams(tiny_llama_dir: Path, mode: str) -> None:
    """Two servers, or two gateways in front of one replica, sharing Redis: they admit no more tokens than one
    limit allows, and a stream dropped on one is resumed on the other."""
    redis_client = redis_or_skip()
    tpm, max_tokens, burst = 800, 40, 24
    with postgres_schema() as schema:
        database_url = postgres_url(schema)
        database = open_database(database_url)
        key, secret = KeyStore(database).create("shared", tpm=tpm)
        _, resumer = KeyStore(database).create("resumer")
        try:
            with replica_for(mode, tiny_llama_dir) as replica_url, \
                    serve(tiny_llama_dir, database_url, "--redis-url", REDIS_URL, replica_url=replica_url) as (_, first), \
                    serve(tiny_llama_dir, database_url, "--redis-url", REDIS_URL, replica_url=replica_url) as (_, second):
                body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens,
                        "ignore_eos": True}
                headers = {"Authorization": f"Bearer {secret}"}
                prompt_tokens = httpx.post(f"{first}/tokenize", json={"messages": body["messages"]},
                                           headers=headers).json()["count"]
                reserve = prompt_tokens + max_tokens

                async def burst_on_both() -> list[int]:
                    async with httpx.AsyncClient(headers=headers, timeout=120) as client:
                        calls = [client.post(f"{(first, second)[i % 2]}/v1/chat/completions", json=body)
                                 for i in range(burst)]
                        return [r.status_code for r in await asyncio.gather(*calls)]

                started = time.monotonic()
                statuses = asyncio.run(burst_on_both())
                elapsed = time.monotonic() - started
                before, after = _dropped_here_resumed_there(first, second, resumer)
        finally:
            redis_client.delete(f"llmserve:rl:{key.id}", f"llmserve:rl:{key.id}:slots")
            database.dispose()
    admitted = statuses.count(200)
    assert set(statuses) == {200, 429}
    refill = tpm / 60 * elapsed  # every admitted request used its whole reservation: nothing came back
    assert admitted * reserve <= tpm + reserve + refill
    assert admitted >= tpm // reserve  # the limit, not something else, decided
    # They share resumable streams through Redis too.
    assert [n for n, _ in before + after] == list(range(len(before + after))) and after[-1][1] == "[DONE]"


def _dropped_here_resumed_there(first: str, second: str, secret: str) -> tuple[list, list]:
    """A resumable stream's first 3 events from `first`, and the rest resumed from `second`: (id, data) each."""
    headers = {"Authorization": f"Bearer {secret}"}
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "ignore_eos": True, "stream": True,
            "stream_options": {"resumable": True}}

    with httpx.stream("POST", f"{first}/v1/chat/completions", json=body, headers=headers, timeout=60) as response:
        stream_id = response.headers["x-stream-id"]
        before = sse_events(response.iter_lines(), stop_after=3)
    with httpx.stream("GET", f"{second}/v1/streams/{stream_id}", headers={**headers, "Last-Event-ID": "2"},
                      timeout=60) as response:
        assert response.status_code == 200
        return before, sse_events(response.iter_lines())


async def _until_draining(base_url: str, timeout_s: float = 30.0) -> None:
    """Until the signalled process has seen its signal: /health answers 503 or nothing (the signal is
    delivered asynchronously, so a request sent right after it may still find the process serving).
    Its own client: the load's connections are all busy streaming."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s) as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get("/health")).status_code != 200:
                    return
            except httpx.TransportError:
                return
            await asyncio.sleep(0.01)
    raise AssertionError("the process did not start draining")


@pytest.mark.parametrize("mode", MODES)
def test_sigterm_under_load_loses_no_usage_record(tiny_llama_dir: Path, tmp_path: Path, mode: str) -> None:
    """SIGTERM to the server, or to the gateway (its replica goes on): what runs finishes and is metered."""
    database_url = f"sqlite:///{tmp_path / 'usage.db'}"
    count = 24
    shutdown = ("--shutdown-timeout", "60") if mode == "direct" else ()  # a gateway waits for what it relays
    with replica_for(mode, tiny_llama_dir) as replica_url, \
            serve(tiny_llama_dir, database_url, *shutdown, replica_url=replica_url) as (proc, base_url):

        async def load() -> tuple[list[str], list[int]]:
            ids: list[str] = []
            async with httpx.AsyncClient(base_url=base_url, timeout=120,
                                         limits=httpx.Limits(max_connections=count)) as client:
                first_chunk = asyncio.Semaphore(0)

                async def one(i: int) -> None:
                    body = {"messages": [{"role": "user", "content": f"Hello {i}"}], "max_tokens": 60,
                            "ignore_eos": True, "stream": True}
                    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                        assert response.status_code == 200
                        signalled = False
                        async for line in response.aiter_lines():
                            if line.startswith("data: {") and not signalled:
                                ids.append(line.split('"id":"', 1)[1].split('"', 1)[0])
                                first_chunk.release()
                                signalled = True

                tasks = [asyncio.ensure_future(one(i)) for i in range(count)]
                for _ in range(count):  # every request is in flight before the signal
                    await first_chunk.acquire()
                proc.send_signal(signal.SIGTERM)
                await _until_draining(base_url)
                late = []
                for _ in range(3):  # draining: refused, and not metered
                    try:
                        late.append((await client.post("/v1/chat/completions", json={
                            "messages": [{"role": "user", "content": "late"}], "max_tokens": 2})).status_code)
                    except httpx.TransportError:
                        late.append(0)  # the listener already closed
                await asyncio.gather(*tasks)
                return ids, late

        ids, late = asyncio.run(load())
        assert proc.wait(timeout=120) == 0
    assert all(status in (503, 0) for status in late)
    database = open_database(database_url)
    with database.session() as session:
        rows = list(session.scalars(select(UsageRecordRow)))
    database.dispose()
    assert sorted(r.request_id for r in rows) == sorted(ids)
    assert all(r.status == "completed" and r.completion_tokens == 60 for r in rows)


@pytest.mark.parametrize("mode", MODES)
def test_serve_takes_named_models_aliases_and_a_config_file(tiny_llama_dir: Path, tmp_path: Path, mode: str) -> None:
    """`llmserve serve` with two models; or a gateway with a pool for each, in front of a replica serving both."""
    config = tmp_path / "platform.yaml"
    config.write_text(
        "prices: {small: {input: 1.0, output: 2.0}}\n"
        "safety: {words: [forbidden], holdback_chars: 16}\n"
    )
    database_url = f"sqlite:///{tmp_path / 'cli.db'}"
    command_models = ["--model", f"small={tiny_llama_dir}", "--model", f"large={tiny_llama_dir}"]
    platform_args = ("--config", str(config), "--alias", "chat=small:50,large:50")
    with ExitStack() as running:
        if mode == "direct":
            base_url = running.enter_context(serve_models(command_models, database_url, *platform_args))
        else:
            replica_url = running.enter_context(serve_models(command_models, None, "--no-platform"))
            pools = ["--pool", f"small={replica_url}", "--pool", f"large={replica_url}"]
            _, base_url = running.enter_context(
                _running([sys.executable, "-m", "llmserve.cli", "gateway", *pools, "--port", "0", "--database-url",
                          database_url, *platform_args], r"llmserve: gateway at (http://\S+)/v1"))
        with httpx.Client(base_url=base_url, timeout=60) as client:
            listed = [m["id"] for m in client.get("/v1/models").json()["data"]]
            chat = client.post("/v1/chat/completions", json={
                "model": "chat", "user": "u1", "max_tokens": 3,
                "messages": [{"role": "user", "content": "Hello"}]})
            blocked = client.post("/v1/chat/completions", json={
                "model": "small", "messages": [{"role": "user", "content": "a forbidden word"}]})
            small = client.post("/v1/completions", json={"model": "small", "prompt": "Hi", "max_tokens": 2})
            report = client.get("/v1/usage", params={"group_by": "model"}).json()
    assert listed == ["small", "large", "chat"]
    assert chat.status_code == 200 and chat.json()["model"] in ("small", "large")
    assert blocked.status_code == 400 and blocked.json()["error"]["code"] == "content_filter"
    usage = small.json()["usage"]
    [small_group] = [g for g in report["data"] if g["group"] == "small"]
    small_usages = [usage] + ([chat.json()["usage"]] if chat.json()["model"] == "small" else [])
    expected = sum(u["prompt_tokens"] * 1.0 + u["completion_tokens"] * 2.0 for u in small_usages) / 1e6
    assert small_group["cost_usd"] == pytest.approx(expected)


@contextmanager
def serve_models(model_args: list[str], database_url: str | None, *extra: str) -> Iterator[str]:
    database = ["--database-url", database_url] if database_url is not None else []
    command = [
        sys.executable, "-m", "llmserve.cli", "serve", *model_args, "--port", "0", "--dtype", "float32",
        "--num-kv-blocks", "128", "--max-model-len", "512", *database, *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = _Lines(proc)
        url = lines.wait_for(r"serving .+ at (http://\S+)/v1").group(1)
        if any("could not load" in line for line in lines.seen):  # what went wrong, not a missing model later
            pytest.fail("a model did not load:\n" + "".join(lines.seen))
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_serve_splits_a_model_over_two_ranks(tiny_llama_dir: Path) -> None:
    """`llmserve serve --tensor-parallel-size 2`: the engine core's process starts the other rank, and a greedy
    completion, and a chat under a JSON schema, come out as one rank's."""
    body = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
              "additionalProperties": False}
    constrained = {"messages": [{"role": "user", "content": "Which city?"}], "max_tokens": 40, "temperature": 0,
                   "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}}
    answers = []
    for ranks in ("1", "2"):
        with serve_models(["--model", str(tiny_llama_dir)], None, "--no-platform", "--tensor-parallel-size", ranks) as url:
            answers.append((
                httpx.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status().json(),
                httpx.post(f"{url}/v1/chat/completions", json=constrained, timeout=60).raise_for_status().json(),
            ))
    (one, one_json), (two, two_json) = answers
    assert two["choices"][0]["text"] == one["choices"][0]["text"] and two["usage"]["completion_tokens"] == 12
    # an output constraint's token masks go to every rank with the step
    assert two_json["choices"][0]["message"]["content"] == one_json["choices"][0]["message"]["content"]
    assert set(json.loads(two_json["choices"][0]["message"]["content"])) == {"city"}
