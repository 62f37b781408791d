"""Anthropic's Message Batches API through Anthropic's own client, with the platform in `llmserve serve` and in
`llmserve gateway`: each request's result is the message `/v1/messages` answers alone, or its error; a cancel ends
the batch with what never ran `canceled`; ended batches are deleted with their results; each batch is its key's
own; malformed batches are 400s naming the request."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest

from llmserve.engine.async_llm import AsyncLLM
from tests.server.platform_fixtures import (
    MODEL,
    MODES,
    PlatformServer,
    serve_platform,
    tiny_engine,  # noqa: F401 - a fixture
)

serving = contextlib.contextmanager(serve_platform)
GREEDY = {"temperature": 0}


@pytest.fixture(params=MODES)
def server(tiny_engine: AsyncLLM, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[PlatformServer]:  # noqa: F811
    yield from serve_platform(tiny_engine, tmp_path, mode=request.param)


def _client(server: PlatformServer, secret: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=secret, max_retries=0)


def _params(text: str, max_tokens: int = 8, **extra) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": text}], **GREEDY, **extra}


def _ended(server: PlatformServer, client: anthropic.Anthropic, batch_id: str):
    seen = []
    assert server.wait_until(lambda: seen.append(client.messages.batches.retrieve(batch_id))
                             or seen[-1].processing_status == "ended", 60), seen[-1]
    return seen[-1]


def test_each_result_is_the_message_answered_alone_or_its_error(server: PlatformServer):
    _, secret = server.new_key("batcher")
    client = _client(server, secret)
    texts = ["Hello there", "Tell me a story"]
    batch = client.messages.batches.create(requests=[
        {"custom_id": "a", "params": _params(texts[0])},
        {"custom_id": "b", "params": _params(texts[1])},
        {"custom_id": "bad", "params": _params("x", max_tokens=8, temperature=5.0)},
    ])
    assert batch.id.startswith("msgbatch_") and batch.processing_status == "in_progress"
    assert batch.request_counts.processing == 3 and batch.results_url is None
    ended = _ended(server, client, batch.id)
    assert ended.request_counts.succeeded == 2 and ended.request_counts.errored == 1
    assert ended.request_counts.processing == ended.request_counts.canceled == 0 and ended.ended_at is not None
    results = {result.custom_id: result.result for result in client.messages.batches.results(batch.id)}
    for custom_id, text in zip("ab", texts, strict=True):
        alone = client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": text}],
                                       extra_body=GREEDY)
        assert results[custom_id].type == "succeeded"
        assert results[custom_id].message.content[0].text == alone.content[0].text
        assert results[custom_id].message.usage.output_tokens == alone.usage.output_tokens
    assert results["bad"].type == "errored" and results["bad"].error.error.type == "invalid_request_error"
    assert "temperature" in results["bad"].error.error.message
    assert [b.id for b in client.messages.batches.list()] == [batch.id]
    assert client.messages.batches.delete(batch.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(batch.id)
    assert list(client.messages.batches.list()) == []


def test_a_cancel_ends_the_batch_with_what_never_ran_canceled(tiny_engine: AsyncLLM, tmp_path: Path):  # noqa: F811
    with serving(tiny_engine, tmp_path, batch_concurrency=1) as server:
        _, secret = server.new_key("batcher")
        client = _client(server, secret)
        long = _params("zzz", max_tokens=300)  # the tiny model answers it with 300 tokens, no end
        batch = client.messages.batches.create(requests=[{"custom_id": f"r{i}", "params": long} for i in range(60)])
        with pytest.raises(anthropic.ConflictError):  # it has not ended
            client.messages.batches.delete(batch.id)
        assert client.messages.batches.cancel(batch.id).processing_status in ("canceling", "ended")
        ended = _ended(server, client, batch.id)
        counts = ended.request_counts
        # (how many ran before the cancel depends on the machine's load: 12 of 30 on a loaded CI machine)
        assert counts.canceled >= 1 and counts.succeeded + counts.errored + counts.canceled == 60
        assert ended.cancel_initiated_at is not None
        results = list(client.messages.batches.results(batch.id))
        assert sorted(r.custom_id for r in results) == sorted(f"r{i}" for i in range(60))
        assert sum(r.result.type == "canceled" for r in results) == counts.canceled
        with pytest.raises(anthropic.ConflictError):
            client.messages.batches.cancel(batch.id)
        stats = server.idle_stats()
        assert stats.num_used_blocks == 0


def test_batches_are_their_keys_own_and_malformed_ones_are_400s(server: PlatformServer):
    _, alice = server.new_key("alice")
    _, bob = server.new_key("bob")
    batch = _client(server, alice).messages.batches.create(requests=[{"custom_id": "a", "params": _params("hi")}])
    with pytest.raises(anthropic.NotFoundError):
        _client(server, bob).messages.batches.retrieve(batch.id)
    with pytest.raises(anthropic.NotFoundError):
        _client(server, bob).messages.batches.cancel(batch.id)
    assert list(_client(server, bob).messages.batches.list()) == []
    newer = [_client(server, alice).messages.batches.create(requests=[{"custom_id": "a", "params": _params("hi")}])
             for _ in range(3)]
    ids = [b.id for b in reversed(newer)] + [batch.id]  # newest first
    first = _client(server, alice).messages.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[:2] and first.has_more and first.last_id == ids[1]
    second = _client(server, alice).messages.batches.list(limit=2, after_id=first.last_id)
    assert [b.id for b in second.data] == ids[2:] and not second.has_more
    back = _client(server, alice).messages.batches.list(limit=2, before_id=ids[3])
    assert [b.id for b in back.data] == ids[1:3] and back.has_more
    assert [b.id for b in _client(server, alice).messages.batches.list(limit=5, before_id=ids[1]).data] == ids[:1]
    for body, param in [
        ({"requests": []}, "requests"),
        ({"requests": [{"custom_id": "a b", "params": _params("hi")}]}, "requests[0].custom_id"),
        ({"requests": [{"custom_id": "a", "params": _params("hi")}] * 2}, "requests[1].custom_id"),
        ({"requests": [{"custom_id": "a", "params": _params("hi", stream=True)}]}, "requests[0].params.stream"),
        ({"requests": [{"custom_id": "a"}]}, "requests[0].params"),
    ]:
        answer = httpx.post(f"{server.base_url}/v1/messages/batches", json=body, timeout=30,
                            headers={"x-api-key": alice})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == param
    for made in (batch, *newer):
        _ended(server, _client(server, alice), made.id)
    early = httpx.get(f"{server.base_url}/v1/messages/batches/msgbatch_unknown/results", headers={"x-api-key": alice})
    assert early.status_code == 404
