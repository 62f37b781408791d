"""What only a gateway's platform meets (its sameness with `llmserve serve`'s is shown by the platform
tests, which run against both): a replica killed mid-stream, metered with what the stream had sent,
and two `llmserve gateway` processes side by side enforcing one RPM limit through Redis and PostgreSQL."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from sqlalchemy import select

from llmserve.engine.async_llm import AsyncLLM
from llmserve.gateway.app import build_gateway_app
from llmserve.platform.conversations import ConversationStore
from llmserve.platform.keys import KeyCache, KeyStore
from llmserve.platform.ratelimit import InProcessRateLimiter
from llmserve.platform.usage import UsageRecorder
from llmserve.server.app import build_app
from llmserve.server.gateway import Platform
from llmserve.server.streaming import PROGRESS_HEADER
from llmserve.store.db import open_database
from llmserve.store.schema import UsageRecordRow
from tests.gateway.test_gateway import MODEL, STARTUP_TIMEOUT_S, Process, _start, _stop, _wait_until
from tests.server.conftest import app_serving, start_server
from tests.server.platform_fixtures import REDIS_URL, redis_or_skip, sse_events, tiny_engine  # noqa: F401 - a fixture
from tests.store.fixtures import postgres_schema, postgres_url


@pytest.fixture
def replica(tiny_llama_dir: Path) -> Iterator[Process]:
    """One `llmserve serve --no-platform` replica of the tiny model, for this test alone."""
    command = [
        sys.executable, "-m", "llmserve.cli", "serve", "--model", str(tiny_llama_dir), "--served-model-name",
        MODEL, "--no-platform", "--port", "0", "--num-kv-blocks", "256", "--max-model-len", "512",
    ]
    proc, ready, found = _start(command, r"serving \S+ at (http://\S+)/v1")
    try:
        assert ready.wait(STARTUP_TIMEOUT_S), "the replica did not start"
        yield Process(proc, found[0])
    finally:
        _stop(proc)


def test_a_replica_killed_mid_stream_ends_it_with_an_error_event_metered_with_what_was_sent(
    replica: Process, tmp_path: Path
) -> None:
    database = open_database(f"sqlite:///{tmp_path / 'platform.db'}")
    platform = Platform(
        keys=KeyCache(KeyStore(database)), limiter=InProcessRateLimiter(),
        usage=UsageRecorder(database, flush_interval=0.2), conversations=ConversationStore(database),
        database=database,
    )
    server, thread, base_url, _ = start_server(build_gateway_app({MODEL: [replica.url]}, platform=platform))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story"}], "max_tokens": 400,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events: list[dict] = []
    try:
        with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                if len(events) == 6:  # the role chunk and five tokens
                    replica.proc.send_signal(signal.SIGKILL)
                    break
            rest = [line for line in lines if line.startswith("data: ")]
        platform.usage.flush()
        with database.session() as session:
            rows = list(session.scalars(select(UsageRecordRow)))
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        database.dispose()
    assert rest[-1] == "data: [DONE]"
    events += [json.loads(line[6:]) for line in rest[:-1]]
    error = events[-1]["error"]
    assert error["code"] == "replica_failed" and set(error) == {"message", "type", "param", "code"}
    sent = [event for event in events if "choices" in event]
    assert all(not event["usage"] or event["choices"] for event in sent)  # the stream broke before its end
    last_usage = sent[-1]["usage"]
    assert 5 <= last_usage["completion_tokens"] < 400
    [row] = rows
    assert row.status == "error" and row.request_id == sent[0]["id"]
    assert (row.prompt_tokens, row.completion_tokens) == (last_usage["prompt_tokens"], last_usage["completion_tokens"])


@contextmanager
def _two_gateways(replica: Process, database_url: str) -> Iterator[tuple[list[subprocess.Popen], list[str]]]:
    """Two `llmserve gateway` processes in front of `replica`, sharing the database and Redis: (processes, URLs).
    They are stopped with SIGTERM (each writes the usage records it still buffers)."""
    command = [sys.executable, "-m", "llmserve.cli", "gateway", "--pool", f"{MODEL}={replica.url}", "--port",
               "0", "--database-url", database_url, "--redis-url", REDIS_URL]
    gateways = [_start(command, r"llmserve: gateway at (http://\S+)/v1") for _ in range(2)]
    try:
        for _, ready, _ in gateways:
            assert ready.wait(STARTUP_TIMEOUT_S), "a gateway did not start"
        yield [proc for proc, _, _ in gateways], [found[0] for _, _, found in gateways]
    finally:
        for proc, _, _ in gateways:
            _stop(proc)


def test_two_gateways_sharing_redis_and_postgresql_enforce_one_rpm_limit(replica: Process) -> None:
    redis_client = redis_or_skip()
    with postgres_schema() as schema:
        database_url = postgres_url(schema)
        database = open_database(database_url)
        key, secret = KeyStore(database).create("shared", rpm=3)
        try:
            with _two_gateways(replica, database_url) as (gateways, (first, second)):
                headers = {"Authorization": f"Bearer {secret}"}
                body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

                def ask(url: str) -> httpx.Response:
                    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)

                answers = [ask(url) for url in (first, second, first, second, first)]
        finally:
            redis_client.delete(f"llmserve:rl:{key.id}", f"llmserve:rl:{key.id}:slots")
        with database.session() as session:
            rows = list(session.scalars(select(UsageRecordRow)))
        database.dispose()
    assert [a.status_code for a in answers] == [200, 200, 200, 429, 429]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers[:3]] == ["2", "1", "0"]
    assert answers[3].json()["error"]["code"] == "rate_limit_exceeded"
    # Metered in the one database, whichever gateway served them; refused requests are not metered.
    assert len(rows) == 3 and {(r.key_id, r.status) for r in rows} == {(key.id, "completed")}
    for proc in gateways:
        assert proc.returncode == 0


def _aborted(replica: Process) -> float:
    metrics = httpx.get(f"{replica.url}/metrics", timeout=10).text
    return float(re.search(r"^llmserve:requests_aborted_total\S* (\S+)$", metrics, re.MULTILINE).group(1))


def _content(events: list[tuple[int, str]]) -> str:
    return "".join(choice["delta"].get("content") or "" for _, data in events if data != "[DONE]"
                   for choice in json.loads(data)["choices"])


def test_gateways_sharing_redis_resume_and_stop_each_others_streams(replica: Process) -> None:
    """Behind a load balancer a client's reconnect reaches any gateway: with --redis-url, each copies the resumable
    streams it relays into Redis, and the others resume them (a chat's, a background response's) and stop them."""
    redis_or_skip()
    with postgres_schema() as schema:
        database_url = postgres_url(schema)
        database = open_database(database_url)
        _, secret = KeyStore(database).create("resumer")
        database.dispose()
        with _two_gateways(replica, database_url) as (gateways, urls):
            first, second = (httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {secret}"})
                             for url in urls)
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 40,
                    "temperature": 0, "ignore_eos": True}
            whole = first.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]

            # A stream dropped on the first gateway after 5 events, resumed on the second.
            resumable = {**body, "stream": True, "stream_options": {"resumable": True}}
            with first.stream("POST", "/v1/chat/completions", json=resumable) as response:
                stream_id = response.headers["x-stream-id"]
                before = sse_events(response.iter_lines(), stop_after=5)
            with second.stream("GET", f"/v1/streams/{stream_id}", headers={"Last-Event-ID": "4"}) as response:
                assert response.status_code == 200
                after = sse_events(response.iter_lines())
            assert [n for n, _ in before + after] == list(range(len(before + after))) and after[-1][1] == "[DONE]"
            assert _content(before + after) == whole

            # A stream followed on the first gateway, stopped from the second: its generation is aborted.
            aborted = _aborted(replica)
            with first.stream("POST", "/v1/chat/completions", json={**resumable, "max_tokens": 450}) as response:
                stream_id = response.headers["x-stream-id"]
                lines = response.iter_lines()
                assert len(sse_events(lines, stop_after=2)) == 2
                deleted = second.delete(f"/v1/streams/{stream_id}")
                rest = sse_events(lines)
            assert deleted.status_code == 200 and deleted.json()["deleted"] is True
            assert len(rest) < 440 and all(data != "[DONE]" for _, data in rest)
            assert _aborted(replica) == aborted + 1
            assert second.get(f"/v1/streams/{stream_id}").status_code == 404

            # A streamed background response made on the first gateway, followed again on the second.
            made = first.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 24,
                                                     "background": True, "stream": True})
            response_id = json.loads(sse_events(iter(made.text.splitlines()), stop_after=1)[0][1])["response"]["id"]
            again = second.get(f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": 1})
            assert again.status_code == 200
            events = [json.loads(data) for _, data in sse_events(iter(again.text.splitlines()))]
            assert [e["sequence_number"] for e in events] == list(range(2, 2 + len(events)))
            assert events[-1]["type"] == "response.completed"
            refused = second.delete(f"/v1/streams/{response_id}")
            assert refused.status_code == 400 and "cancel" in refused.json()["error"]["message"]

            # A background response run by the first gateway, cancelled through the second: its run is stopped.
            aborted = _aborted(replica)
            queued = first.post("/v1/responses", json={"model": MODEL, "input": "List every prime number.",
                                                       "max_output_tokens": 450, "background": True}).json()
            _wait_until(lambda: first.get(f"/v1/responses/{queued['id']}").json()["status"] == "in_progress", 30,
                        "the response to start")
            cancelled = second.post(f"/v1/responses/{queued['id']}/cancel")
            assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
            _wait_until(lambda: _aborted(replica) == aborted + 1, 30, "the run to be aborted")
            assert first.get(f"/v1/responses/{queued['id']}").json()["status"] == "cancelled"
            first.close()
            second.close()
    for proc in gateways:
        assert proc.returncode == 0


def test_the_gateway_with_its_platform_loads_without_torch() -> None:
    """A gateway process holds no engine: it stays small and starts fast."""
    code = "import sys, llmserve.gateway.serve, llmserve.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def _breaking_replica(hits: list[str]) -> FastAPI:
    """A replica that reports some usage for a non-streamed request, then dies mid-reply."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> StreamingResponse:
        hits.append(request.headers.get(PROGRESS_HEADER, ""))

        async def events():
            yield 'data: {"usage": {"prompt_tokens": 9, "completion_tokens": 16, "total_tokens": 25}}\n\n'
            raise RuntimeError("the replica died")

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_a_non_streamed_request_whose_replica_dies_mid_reply_is_retried_on_another(
    tiny_engine: AsyncLLM, tmp_path: Path  # noqa: F811
) -> None:
    hits: list[str] = []
    database = open_database(f"sqlite:///{tmp_path / 'platform.db'}")
    platform = Platform(keys=KeyCache(KeyStore(database)), usage=UsageRecorder(database, flush_interval=0.2),
                        database=database)
    with ExitStack() as servers:
        urls = [servers.enter_context(app_serving(app)) for app in (_breaking_replica(hits), build_app(tiny_engine, MODEL))]
        base_url = servers.enter_context(app_serving(build_gateway_app({MODEL: urls}, "round_robin", platform=platform)))
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "ignore_eos": True}
        answers = [httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60) for _ in range(2)]
        platform.usage.flush()
        with database.session() as session:
            rows = list(session.scalars(select(UsageRecordRow)))
    assert hits == ["1"]  # asked for progress events; round robin sent it one of the two
    assert [a.status_code for a in answers] == [200, 200]
    assert [a.json()["usage"]["completion_tokens"] for a in answers] == [5, 5]
    assert sorted((r.status, r.completion_tokens) for r in rows) == [("completed", 5)] * 2


def test_a_chats_token_count_is_asked_for_the_prompt_its_reasoning_effort_renders() -> None:
    """The replica passes `reasoning_effort` to the chat template as a variable; the gateway's count of the prompt
    (for the key's TPM reservation) asks for the same render."""
    from llmserve.server.chat_translation import chat_tokenize_body

    messages = [{"role": "user", "content": "Hi"}]
    body = chat_tokenize_body(MODEL, {"messages": messages, "reasoning_effort": "low",
                                  "chat_template_kwargs": {"enable_thinking": False}})
    assert body["chat_template_kwargs"] == {"enable_thinking": False, "reasoning_effort": "low"}
    assert "chat_template_kwargs" not in chat_tokenize_body(MODEL, {"messages": messages})
