"""OpenAI's Files and Batch APIs over the tiny model, with the platform in `llmserve serve` and in `llmserve
gateway`: a batch's requests are answered as the same requests sent one by one, metered to the key that made the
batch; a file that is no batch fails it, naming its lines; a cancel stops what runs and frees its KV; a batch taken
over after its runner died runs only the requests that had no result; every refusal is OpenAI's error."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import update

from llmserve.config import EngineConfig
from llmserve.engine.async_llm import AsyncLLM
from llmserve.platform import batches as batches_module
from llmserve.platform.batches import BatchStore, FileStore
from llmserve.platform.keys import KeyStore
from llmserve.server.batch_runner import _retry_after
from llmserve.store.db import open_database
from llmserve.store.schema import FileRow, utcnow
from tests.server.conftest import one_thread_engine_cores
from tests.server.platform_fixtures import (
    MODEL,
    MODES,
    PlatformServer,
    chat_body,
    serve_platform,
    tiny_engine,  # noqa: F401 - a fixture
)

FINAL = ("completed", "failed", "expired", "cancelled")
serving = contextlib.contextmanager(serve_platform)  # the platform in `llmserve serve`, with options of the test's


@pytest.fixture(params=MODES)
def server(tiny_engine: AsyncLLM, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[PlatformServer]:  # noqa: F811
    yield from serve_platform(tiny_engine, tmp_path, mode=request.param)


def _openai(server: PlatformServer, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=secret, max_retries=0)


def _jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _chat_line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _ended(client: openai.OpenAI, server: PlatformServer, batch_id: str, timeout: float = 60):
    batches = []
    assert server.wait_until(lambda: batches.append(client.batches.retrieve(batch_id)) or batches[-1].status in FINAL,
                             timeout), f"batch {batch_id} did not end: {batches[-1]}"
    return batches[-1]


def _long_batch(server: PlatformServer, client: openai.OpenAI, count: int):
    """A batch of `count` requests of 300 tokens each, once its runner has started it: (its input file, it)."""
    lines = [_chat_line(f"r{i}", **chat_body(max_tokens=300, ignore_eos=True)) for i in range(count)]
    uploaded = client.files.create(file=("long.jsonl", _jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert server.wait_until(lambda: client.batches.retrieve(batch.id).status == "in_progress")
    return uploaded, batch


def _records(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()] if file_id else []


def test_a_batch_answers_each_request_as_if_sent_alone_and_meters_it_to_its_key(server: PlatformServer):
    key, secret = server.new_key("batcher")
    client = _openai(server, secret)
    bodies = {
        "greeting": chat_body("Hello there", max_tokens=6, temperature=0),
        "story": chat_body("Once upon a time", max_tokens=5, temperature=0),
        "bad": chat_body("Hi", max_tokens=3, frobnicate=True),  # an unknown field: this request's own 400
    }
    lines = [_chat_line(custom_id, **body) for custom_id, body in bodies.items()]
    uploaded = client.files.create(file=("requests.jsonl", _jsonl(lines)), purpose="batch")
    assert (uploaded.purpose, uploaded.bytes, uploaded.filename) == ("batch", len(_jsonl(lines)), "requests.jsonl")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}

    batch = _ended(client, server, batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (3, 2, 1)
    assert batch.completed_at >= batch.in_progress_at >= batch.created_at

    outputs = _records(client, batch.output_file_id)
    assert [record["custom_id"] for record in outputs] == ["greeting", "story"]
    with server.client(secret) as http:
        for record in outputs:
            alone = http.post("/v1/chat/completions", json=bodies[record["custom_id"]]).json()
            assert record["response"]["status_code"] == 200 and record["error"] is None
            answer = record["response"]["body"]
            assert answer["choices"][0]["message"] == alone["choices"][0]["message"]
            assert answer["usage"] == alone["usage"] and record["response"]["request_id"] == answer["id"]
    [error] = _records(client, batch.error_file_id)
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["param"] == "frobnicate"

    answered = [record["response"]["body"]["usage"] for record in outputs]
    assert (batch.usage.input_tokens, batch.usage.output_tokens, batch.usage.total_tokens) == (
        sum(u["prompt_tokens"] for u in answered), sum(u["completion_tokens"] for u in answered),
        sum(u["total_tokens"] for u in answered))
    rows = server.wait_for_usage_rows(4)  # the two batch requests, then the same two sent alone
    assert [row.key_id for row in rows] == [key.id] * 4
    assert sorted(row.completion_tokens for row in rows[:2]) == sorted(
        record["response"]["body"]["usage"]["completion_tokens"] for record in outputs)
    with server.client(secret) as http:
        metrics = http.get("/metrics").text
    assert 'llmserve:batch_requests_total{outcome="succeeded"} 2.0' in metrics
    assert 'llmserve:batch_requests_total{outcome="failed"} 1.0' in metrics
    assert 'llmserve:batches_ended_total{status="completed"} 1.0' in metrics
    listed = client.files.list()
    assert {f.purpose for f in listed.data} == {"batch", "batch_output"} and len(listed.data) == 3
    assert [b.id for b in client.batches.list().data] == [batch.id]


def test_a_file_that_is_no_batch_fails_it_naming_each_bad_line(server: PlatformServer):
    _, secret = server.new_key("batcher")
    client = _openai(server, secret)
    content = b"\n".join([
        json.dumps(_chat_line("a", **chat_body())).encode(),
        b"{not json",
        json.dumps(_chat_line("a", **chat_body())).encode(),  # the same custom_id again
        json.dumps({**_chat_line("c", **chat_body()), "url": "/v1/completions"}).encode(),
        json.dumps(_chat_line("d", **chat_body(stream=True))).encode(),
    ])
    uploaded = client.files.create(file=("bad.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = _ended(client, server, batch.id)
    assert batch.status == "failed" and batch.failed_at is not None and batch.output_file_id is None
    found = [(error.line, error.param, error.code) for error in batch.errors.data]
    assert found == [(2, None, "invalid_json_line"), (3, "custom_id", "invalid_request"), (4, "url", "invalid_request"),
                     (5, "body.stream", "invalid_request")]
    assert server.count_usage_rows() == 0


def test_files_and_batches_are_their_keys_own(server: PlatformServer):
    _, alice = server.new_key("alice")
    _, bob = server.new_key("bob")
    client = _openai(server, alice)
    uploaded = client.files.create(file=("a.jsonl", _jsonl([_chat_line("x", **chat_body())])), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    other = _openai(server, bob)
    for call in (lambda: other.files.retrieve(uploaded.id), lambda: other.files.content(uploaded.id),
                 lambda: other.files.delete(uploaded.id), lambda: other.batches.retrieve(batch.id),
                 lambda: other.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError):  # a batch over another key's file
        other.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert other.files.list().data == [] and other.batches.list().data == []
    assert _ended(client, server, batch.id).status == "completed"


def test_cancel_stops_the_running_requests_and_frees_their_kv(tiny_engine: AsyncLLM, tmp_path: Path):  # noqa: F811
    with serving(tiny_engine, tmp_path, batch_concurrency=2) as server:
        _, secret = server.new_key("batcher")
        client = _openai(server, secret)
        uploaded, batch = _long_batch(server, client, 8)
        with pytest.raises(openai.ConflictError):  # the input of a batch still running
            client.files.delete(uploaded.id)
        assert client.batches.cancel(batch.id).status == "cancelling"
        batch = _ended(client, server, batch.id)
        assert batch.status == "cancelled" and batch.cancelled_at is not None
        errors = _records(client, batch.error_file_id)
        assert {record["custom_id"] for record in errors} | {r["custom_id"] for r in _records(client, batch.output_file_id)} \
            == {f"r{i}" for i in range(8)}
        assert all(record["error"]["code"] == "batch_cancelled" for record in errors if record["response"] is None)
        stats = server.idle_stats()
        assert stats.num_used_blocks == 0 and stats.num_free_blocks == stats.num_blocks
        with pytest.raises(openai.ConflictError):
            client.batches.cancel(batch.id)
        assert client.files.delete(uploaded.id).deleted


def test_a_batch_taken_over_after_its_runner_died_runs_only_what_had_no_result(tiny_engine: AsyncLLM,  # noqa: F811
                                                                                 tmp_path: Path):
    # Made through another server sharing the database, whose runner answered r0 and died: its lease has lapsed.
    # (Before this server starts, so that its own runner cannot claim the batch first.)
    database = open_database(f"sqlite:///{tmp_path / 'platform.db'}")
    key, secret = KeyStore(database).create("batcher")
    store = BatchStore(database, FileStore(database, 1 << 20))
    lines = [_chat_line(f"r{i}", **chat_body(max_tokens=3)) for i in range(3)]
    uploaded = store.files.create(key.id, "in.jsonl", "batch", _jsonl(lines))
    made = store.create(key.id, uploaded["id"], "/v1/chat/completions", "24h", None)
    assert store.claim("runner_dead", timedelta(0)).id == made["id"]
    store.start(made["id"], "runner_dead", 3)
    earlier = {"id": "batch_req_earlier", "custom_id": "r0", "response": {"status_code": 200, "request_id": "x",
                                                                          "body": {"earlier": True}}, "error": None}
    store.save_result(made["id"], 0, True, earlier)
    database.dispose()
    with serving(tiny_engine, tmp_path) as server:
        client = _openai(server, secret)
        batch = _ended(client, server, made["id"])
        assert batch.status == "completed" and batch.request_counts.completed == 3
        outputs = _records(client, batch.output_file_id)
        assert [record["custom_id"] for record in outputs] == ["r0", "r1", "r2"] and outputs[0] == earlier
        assert len(server.wait_for_usage_rows(2)) == 2  # r1 and r2 only


def test_refusals_are_openai_errors(server: PlatformServer):
    _, secret = server.new_key("batcher")
    client = _openai(server, secret)
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    uploaded = client.files.create(file=("a.jsonl", _jsonl([_chat_line("x", **chat_body())])), purpose="batch")
    for endpoint, window, param in (("/v1/images/generations", "24h", "endpoint"), ("/v1/chat/completions", "1h",
                                                                                   "completion_window")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window=window)
        assert refused.value.body["param"] == param
    with server.client(secret) as http:
        too_big = http.post("/v1/files", files={"file": ("big.jsonl", b"x" * (2 << 20))}, data={"purpose": "batch"})
        assert too_big.status_code == 413 and too_big.json()["error"]["code"]
        extra = http.post("/v1/batches", json={"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions",
                                               "completion_window": "24h", "priority": 1})
        assert extra.status_code == 400 and extra.json()["error"]["param"] == "priority"
        assert http.get("/v1/files/file-nope/content").status_code == 404
        for fields, param in (({"expires_after[anchor]": "last_used", "expires_after[seconds]": "3600"},
                               "expires_after.anchor"),
                              ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"},
                               "expires_after.seconds"),
                              ({"expires_after[seconds]": "3600"}, "expires_after")):
            refused = http.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")}, data={"purpose": "batch", **fields})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h",
                              output_expires_after={"anchor": "created_at", "seconds": 10})
    assert refused.value.body["param"] == "output_expires_after.seconds"


def test_files_are_kept_as_long_as_asked_and_are_gone_after(server: PlatformServer):
    _, secret = server.new_key("batcher")
    client = _openai(server, secret)
    lines = _jsonl([_chat_line("x", **chat_body(max_tokens=2))])
    kept = client.files.create(file=("a.jsonl", lines), purpose="batch")
    brief = client.files.create(file=("b.jsonl", lines), purpose="batch",
                                expires_after={"anchor": "created_at", "seconds": 3600})
    assert (kept.expires_at - kept.created_at, brief.expires_at - brief.created_at) == (30 * 86400, 3600)
    batch = client.batches.create(input_file_id=kept.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  output_expires_after={"anchor": "created_at", "seconds": 7200})
    output = client.files.retrieve(_ended(client, server, batch.id).output_file_id)
    assert output.expires_at - output.created_at == 7200
    with server.database.session(write=True) as session:  # an hour on
        session.execute(update(FileRow).where(FileRow.id == brief.id).values(expires_at=utcnow()))
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(brief.id)
    assert brief.id not in [file.id for file in client.files.list()]


def test_a_refusal_for_the_moment_is_sent_again_after_the_wait_asked_for():
    assert _retry_after(429, {"retry-after": "2"}) == 2.0
    assert _retry_after(503, {"retry-after": "900"}) == 30.0  # waits are capped
    assert _retry_after(429, {}) is None  # no Retry-After (a quota spent for good): the answer is the result
    assert _retry_after(400, {"retry-after": "1"}) is None


def test_without_a_platform_the_batch_api_is_not_there(live_server):
    with httpx.Client(base_url=live_server.base_url) as http:
        assert http.get("/v1/batches").status_code == 404
        assert http.get("/v1/files").status_code == 404


def test_a_model_the_key_may_not_use_fails_only_its_requests(server: PlatformServer):
    _, secret = server.new_key("limited", models=["other-model"])
    client = _openai(server, secret)
    uploaded = client.files.create(file=("a.jsonl", _jsonl([_chat_line("x", **chat_body())])), purpose="batch")
    batch = _ended(client, server, client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h").id)
    [error] = _records(client, batch.error_file_id)
    assert batch.status == "completed" and error["response"]["status_code"] in (403, 404)
    assert MODEL in json.dumps(error["response"]["body"])


def test_a_batch_past_its_window_expires_with_what_had_not_run(
    tiny_engine: AsyncLLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
):
    with serving(tiny_engine, tmp_path) as server:
        key, secret = server.new_key("batcher")
        store: BatchStore = server.platform.batches
        uploaded = store.files.create(key.id, "in.jsonl", "batch", _jsonl([_chat_line("late", **chat_body())]))
        with monkeypatch.context() as patch:  # made a day ago, and no runner took it since (none can now)
            patch.setattr(batches_module, "utcnow", lambda: utcnow() - timedelta(hours=24, seconds=1))
            made = store.create(key.id, uploaded["id"], "/v1/chat/completions", "24h", None)
        server.platform.batch_runner.wake()
        client = _openai(server, secret)
        batch = _ended(client, server, made["id"])
        assert batch.status == "expired" and batch.expired_at is not None and batch.output_file_id is None
        [record] = _records(client, batch.error_file_id)
        assert record["custom_id"] == "late" and record["error"]["code"] == "batch_expired"
        assert server.count_usage_rows() == 0


def test_a_batch_whose_key_was_revoked_fails_what_it_had_not_run(tiny_engine: AsyncLLM, tmp_path: Path):  # noqa: F811
    with serving(tiny_engine, tmp_path) as server:
        key, _ = server.new_key("batcher")
        store: BatchStore = server.platform.batches
        lines = [_chat_line(f"r{i}", **chat_body(max_tokens=3)) for i in range(3)]
        uploaded = store.files.create(key.id, "in.jsonl", "batch", _jsonl(lines))
        server.keys.revoke(key.id)  # after the batch was made (through another server), before it ran
        made = store.create(key.id, uploaded["id"], "/v1/chat/completions", "24h", None)
        server.platform.batch_runner.wake()
        assert server.wait_until(lambda: store.get(key.id, made["id"])["status"] in FINAL)
        batch = store.get(key.id, made["id"])
        assert batch["status"] == "failed" and batch["errors"]["data"][0]["code"] == "key_revoked"
        assert batch["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
        errors = [json.loads(line) for line in store.files.content(key.id, batch["error_file_id"]).splitlines()]
        assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(f"r{i}", "key_revoked") for i in range(3)]
        assert server.count_usage_rows() == 0


def test_under_the_priority_policy_an_interactive_request_goes_before_waiting_batch_requests(tiny_llama_dir,
                                                                                             tmp_path: Path):
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=256, max_model_len=512,
                          max_num_seqs=1, scheduling_policy="priority")
    with one_thread_engine_cores():
        engine = AsyncLLM.from_config(config)
    try:
        with serving(engine, tmp_path, batch_concurrency=3) as server:
            _, secret = server.new_key("batcher")
            client = _openai(server, secret)
            _, made = _long_batch(server, client, 3)
            # One batch request runs (one sequence at a time), the other two wait.
            assert server.wait_until(lambda: asyncio.run_coroutine_threadsafe(
                engine.stats(), server.loop).result().num_waiting == 2)
            with server.client(secret) as http:
                assert http.post("/v1/chat/completions", json=chat_body(max_tokens=5)).status_code == 200
            # It ran as soon as the running batch request ended, before the two that were waiting.
            assert client.batches.retrieve(made.id).request_counts.completed <= 1
            assert _ended(client, server, made.id).request_counts.completed == 3
    finally:
        engine.close()


def test_a_small_batch_is_not_held_up_until_a_large_one_ends(tiny_engine: AsyncLLM, tmp_path: Path):  # noqa: F811
    with serving(tiny_engine, tmp_path, batch_concurrency=2) as server:
        _, secret = server.new_key("batcher")
        client = _openai(server, secret)
        _, large = _long_batch(server, client, 10)
        uploaded = client.files.create(file=("small.jsonl", _jsonl([_chat_line("s", **chat_body())])), purpose="batch")
        small = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")
        assert _ended(client, server, small.id).status == "completed"
        assert client.batches.retrieve(large.id).status == "in_progress"  # it takes turns with the large one
        assert _ended(client, server, large.id).request_counts.completed == 10
