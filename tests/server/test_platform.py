"""The platform over HTTP: API keys, model permissions, RPM/TPM limits with OpenAI's headers, usage
metering and /v1/usage, conversations, safety filters, and several models behind one server."""

from __future__ import annotations

import asyncio
import gc
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmserve.engine.async_llm import AsyncLLM
from llmserve.platform.safety import RuleSetFilter
from llmserve.platform.usage import Price, PriceTable
from llmserve.server.app import ModelSpec
from llmserve.server.gateway import PROGRESS_EVERY_TOKENS
from tests.server.platform_fixtures import (
    MODEL,
    MODES,
    PlatformServer,
    chat_body,
    serve_platform,
    tiny_engine,  # noqa: F401 - a fixture
)


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    """The platform in `llmserve serve` or in `llmserve gateway`."""
    return request.param


@pytest.fixture
def server(tiny_engine: AsyncLLM, tmp_path: Path, mode: str) -> Iterator[PlatformServer]:  # noqa: F811
    prices = PriceTable({MODEL: Price(input_per_million=2.0, cached_input_per_million=1.0, output_per_million=8.0)})
    yield from serve_platform(tiny_engine, tmp_path, prices=prices, mode=mode)


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def metric_value(base_url: str, name: str, labels: dict[str, str], key: str | None = None) -> float:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text = httpx.get(f"{base_url}/metrics", headers=headers).raise_for_status().text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


# ---- keys ------------------------------------------------------------------------------------------


def test_without_keys_the_server_is_open_and_meters_requests_as_local(server: PlatformServer) -> None:
    with server.client() as client:
        response = client.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 200
    usage = response.json()["usage"]
    [row] = server.wait_for_usage_rows(1)
    assert row.key_id is None and row.model == MODEL and row.status == "completed"
    assert (row.prompt_tokens, row.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])


def test_a_body_nested_past_any_limit_is_a_400_and_metered_as_nothing(server: PlatformServer) -> None:
    """Past the JSON parser's own depth, and past the server's 100 levels (copying or compiling schemas
    that deep was a 500)."""
    for levels in (3000, 300):
        deep = b'{"a": ' * levels + b'"x"' + b"}" * levels
        body = json.dumps(chat_body()).encode()[:-1] + b', "user": ' + deep + b"}"
        with server.client() as client:
            response = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["type"] == "invalid_request_error"
    assert server.idle_stats().num_used_blocks == 0


def test_a_responses_api_request_is_metered_and_keyed_as_its_chat(server: PlatformServer) -> None:
    """/v1/responses runs as a chat completion through either platform: the key is checked, and the
    usage stored is the response's, whole or streamed."""
    body = {"model": MODEL, "input": "Hello there", "max_output_tokens": 4, "temperature": 0}
    key, secret = server.new_key("alice")
    with server.client() as client:
        assert client.post("/v1/responses", json=body).status_code == 401
    with server.client(secret) as client:
        whole = client.post("/v1/responses", json=body)
        streamed = client.post("/v1/responses", json={**body, "stream": True})
    assert whole.status_code == streamed.status_code == 200, whole.text
    usage = whole.json()["usage"]
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["usage"] == usage
    assert events[-1]["response"]["output"] == [{**whole.json()["output"][0], "id": events[-1]["response"]["output"][0]["id"]}]
    rows = server.wait_for_usage_rows(2)
    assert [(r.key_id, r.prompt_tokens, r.completion_tokens) for r in rows] == [
        (key.id, usage["input_tokens"], usage["output_tokens"])] * 2


def test_once_a_key_exists_every_v1_request_needs_a_valid_one(server: PlatformServer) -> None:
    key, secret = server.new_key("alice")
    _, bob = server.new_key("bob")  # stays active: revoking alice's key must not reopen the server
    server.clock.advance(3)  # past the cached "no keys exist"
    with server.client() as anonymous:
        missing = anonymous.post("/v1/chat/completions", json=chat_body())
        models = anonymous.get("/v1/models")
        assert anonymous.get("/health").status_code == 200  # the health check needs no key
    assert missing.status_code == 401 and error_of(missing)["code"] == "missing_api_key"
    assert models.status_code == 401
    with server.client("not-a-key") as client:
        malformed = client.post("/v1/chat/completions", json=chat_body())
    assert malformed.status_code == 401 and error_of(malformed)["code"] == "invalid_api_key"
    with server.client("sk-llms-" + "x" * 43) as client:
        unknown = client.post("/v1/chat/completions", json=chat_body())
    assert unknown.status_code == 401 and error_of(unknown)["type"] == "invalid_request_error"
    with server.client(secret) as client:
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200
        server.keys.revoke(key.id)
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200  # still cached
        server.clock.advance(3)
        revoked = client.post("/v1/chat/completions", json=chat_body())
    assert revoked.status_code == 401 and error_of(revoked)["code"] == "invalid_api_key"
    assert metric_value(server.base_url, "llmserve:auth_failures_total", {"reason": "invalid_api_key"}, bob) == 3


def test_a_key_limited_to_some_models_gets_404_for_the_others(
    tiny_engine: AsyncLLM, tmp_path: Path, mode: str  # noqa: F811
) -> None:
    models = [ModelSpec("small", tiny_engine), ModelSpec("large", tiny_engine)]
    aliases = {"chat": [("small", 1.0)]}
    for server in serve_platform(tiny_engine, tmp_path, models=models, aliases=aliases, mode=mode):
        _, secret = server.new_key("bob", models=["small", "chat"])
        with server.client(secret) as client:
            assert client.post("/v1/chat/completions", json=chat_body(model="small")).status_code == 200
            assert client.post("/v1/chat/completions", json=chat_body(model="chat")).status_code == 200
            denied = client.post("/v1/chat/completions", json=chat_body(model="large"))
            listed = [m["id"] for m in client.get("/v1/models").json()["data"]]
            hidden = client.get("/v1/models/large")
        assert denied.status_code == 404 and error_of(denied)["code"] == "model_not_found"
        assert listed == ["small", "chat"]
        assert hidden.status_code == 404


# ---- rate limits -----------------------------------------------------------------------------------


def test_rpm_limit_answers_429_with_openai_headers(server: PlatformServer) -> None:
    _, secret = server.new_key("rpm", rpm=2)
    with server.client(secret) as client:
        first = client.post("/v1/chat/completions", json=chat_body())
        second = client.post("/v1/chat/completions", json=chat_body())
        third = client.post("/v1/chat/completions", json=chat_body())
    assert (first.status_code, second.status_code, third.status_code) == (200, 200, 429)
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-ratelimit-reset-requests"] == "1m0s"  # it counts for a minute
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-limit-tokens" not in first.headers  # no token limit on this key
    error = error_of(third)
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert third.headers["retry-after"] == "60" and third.headers["retry-after-ms"] == "60000"
    assert third.headers["x-ratelimit-reset-requests"] == "1m0s"
    assert metric_value(server.base_url, "llmserve:rate_limited_requests_total", {"limit": "requests"}, secret) == 1
    server.clock.advance(59.9)  # the frozen clock: the first two still count until a minute has passed
    with server.client(secret) as client:
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 429
        server.clock.advance(0.1)
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200


def test_tpm_reserves_prompt_plus_max_tokens_and_settles_to_what_was_used(server: PlatformServer) -> None:
    _, secret = server.new_key("tpm", tpm=600)
    body = chat_body(max_tokens=250)
    long_stream = {**body, "stream": True, "ignore_eos": True}
    with server.client(secret) as client:
        prompt_tokens = client.post("/tokenize", json={"model": MODEL, "messages": body["messages"]}).json()["count"]
        reserve = prompt_tokens + 250
        # Two streams held open hold two reservations, so a third request does not fit.
        with client.stream("POST", "/v1/chat/completions", json=long_stream) as a:
            with client.stream("POST", "/v1/chat/completions", json=long_stream) as b:
                assert a.status_code == b.status_code == 200
                assert int(a.headers["x-ratelimit-remaining-tokens"]) == 600 - reserve
                assert int(b.headers["x-ratelimit-remaining-tokens"]) == 600 - 2 * reserve
                third = client.post("/v1/chat/completions", json=body)
                next(a.iter_lines()), next(b.iter_lines())  # then hang up on both
        assert third.status_code == 429
        error = error_of(third)
        assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
        # Both reservations count until they are a minute old (unless settled first).
        assert third.headers["retry-after-ms"] == "60000" and third.headers["retry-after"] == "60"
        assert third.headers["x-ratelimit-remaining-tokens"] == str(600 - 2 * reserve)
        # Cut short, each stream settled to what it used: prompt plus the tokens generated.
        rows = server.wait_for_usage_rows(2)
        used = sum(r.prompt_tokens + r.completion_tokens for r in rows)
        assert all(r.completion_tokens < 250 for r in rows)
        fourth = client.post("/v1/chat/completions", json=chat_body(max_tokens=5))
    assert fourth.status_code == 200
    assert int(fourth.headers["x-ratelimit-remaining-tokens"]) == 600 - used - (prompt_tokens + 5)


def test_a_request_refused_as_invalid_counts_against_no_limit_and_is_not_metered(server: PlatformServer) -> None:
    _, secret = server.new_key("strict", rpm=2, tpm=100_000)
    with server.client(secret) as client:
        max_model_len = client.post("/tokenize", json={"model": MODEL, "prompt": ""}).json()["max_model_len"]
        too_long = client.post("/v1/chat/completions", json=chat_body("hello " * max_model_len))
        answers = [client.post("/v1/chat/completions", json=chat_body()) for _ in range(3)]
        prompt = client.post("/tokenize", json={"model": MODEL, "messages": chat_body()["messages"]}).json()["count"]
    assert too_long.status_code == 400 and error_of(too_long)["type"] == "invalid_request_error"
    assert "x-ratelimit-remaining-requests" not in too_long.headers
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert answers[0].headers["x-ratelimit-remaining-requests"] == "1"
    assert int(answers[0].headers["x-ratelimit-remaining-tokens"]) == 100_000 - (prompt + 4)
    assert len(server.wait_for_usage_rows(2)) == 2


def test_tpm_reserves_a_chats_tools_as_part_of_its_prompt(server: PlatformServer) -> None:
    _, secret = server.new_key("tools", tpm=100_000)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    body = chat_body(max_tokens=3, tools=tools, tool_choice="none")
    with server.client(secret) as client:
        prompt = client.post("/tokenize", json={"model": MODEL, "messages": body["messages"], "tools": tools})
        without_tools = client.post("/tokenize", json={"model": MODEL, "messages": body["messages"]})
        response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert prompt.json()["count"] > without_tools.json()["count"]
    assert response.json()["usage"]["prompt_tokens"] == prompt.json()["count"]
    assert int(response.headers["x-ratelimit-remaining-tokens"]) == 100_000 - (prompt.json()["count"] + 3)


def test_a_request_larger_than_the_token_limit_is_refused_outright(server: PlatformServer) -> None:
    _, secret = server.new_key("small-tpm", tpm=50)
    with server.client(secret) as client:
        response = client.post("/v1/chat/completions", json=chat_body(max_tokens=100))
    assert response.status_code == 429
    error = error_of(response)
    assert error["type"] == "tokens" and "Request too large" in error["message"]
    assert "retry-after" not in response.headers


# ---- usage -----------------------------------------------------------------------------------------


# What a stream that will be dropped asks for: as much as the tiny model's context allows, so that its
# client (a thread of this busy test process, with the gateway's and the replica's) hangs up long before
# the engine core could finish it; with 200 tokens a loaded CI machine once let one run to its end.
DROPPED_STREAM_TOKENS = 448  # + the chat prompt (under 64 tokens) fits MAX_MODEL_LEN (512)


async def _drive_mixed_load(base_url: str, secret: str, count: int) -> tuple[list[dict], list[int]]:
    """`count` concurrent requests: streamed, not streamed, and streams dropped after a few chunks.
    Returns the usage of the finished ones and the tokens the dropped ones had received."""
    finished: list[dict] = []
    dropped: list[int] = []
    headers = {"Authorization": f"Bearer {secret}"}
    limits = httpx.Limits(max_connections=count)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120, limits=limits) as client:

        async def one(i: int) -> None:
            body = chat_body(f"Request number {i} says hello", max_tokens=6 + i % 7)
            if i % 3 == 0:
                response = await client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200
                finished.append(response.json()["usage"])
                return
            stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
            if i % 3 == 2:
                stream_body.update(max_tokens=DROPPED_STREAM_TOKENS, ignore_eos=True)
            async with client.stream("POST", "/v1/chat/completions", json=stream_body) as response:
                assert response.status_code == 200
                chunks = 0
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if event.get("usage"):
                        finished.append(event["usage"])
                    chunks += 1
                    if i % 3 == 2 and chunks == 4:  # the role chunk and three tokens, then hang up
                        dropped.append(3)
                        return

        await asyncio.gather(*(one(i) for i in range(count)))
    return finished, dropped


def test_usage_records_equal_the_responses_usage_under_concurrent_load_with_disconnects(
    server: PlatformServer,
) -> None:
    _, secret = server.new_key("load")
    # A full collection stops every thread of this process (client, gateway, replica) for ~0.3 s, long
    # enough for the engine core, a process of its own, to run the dropped streams to their end before
    # their clients can hang up: no collection while the load runs.
    gc.disable()
    try:
        finished, dropped = asyncio.run(_drive_mixed_load(server.base_url, secret, 100))
    finally:
        gc.enable()
    assert len(finished) + len(dropped) == 100 and len(dropped) == 33
    rows = server.wait_for_usage_rows(100)
    assert len(rows) == 100 and len({r.request_id for r in rows}) == 100
    completed = [r for r in rows if r.status == "completed"]
    disconnected = [r for r in rows if r.status == "disconnected"]
    assert (len(completed), len(disconnected)) == (67, 33)
    assert sum(r.prompt_tokens for r in completed) == sum(u["prompt_tokens"] for u in finished)
    assert sum(r.completion_tokens for r in completed) == sum(u["completion_tokens"] for u in finished)
    # A dropped stream is billed for what was generated: at least what the client received, and less
    # than it asked for (the abort came within a step or two of the hang-up).
    assert all(3 <= r.completion_tokens < DROPPED_STREAM_TOKENS for r in disconnected)
    assert all(r.ttft_ms is not None and r.latency_ms >= r.ttft_ms for r in rows)


def test_a_non_streamed_request_whose_client_leaves_is_metered_with_what_was_generated(
    server: PlatformServer,
) -> None:
    assert server.loop is not None

    def steps() -> int:
        return asyncio.run_coroutine_threadsafe(server.engine.stats(), server.loop).result(timeout=30).num_steps

    async def leave_mid_generation(generated: int) -> None:
        started_at = await asyncio.to_thread(steps)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            body = chat_body("Tell me a long story", max_tokens=400, ignore_eos=True)
            request = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
            while await asyncio.to_thread(steps) < started_at + generated:  # polls the engine's progress
                assert not request.done()
            request.cancel()  # the client hangs up mid-generation

    generated = 3 * PROGRESS_EVERY_TOKENS
    asyncio.run(leave_mid_generation(generated))
    [row] = server.wait_for_usage_rows(1)
    prompt_tokens = server.client().post("/tokenize", json={"model": MODEL, "messages": chat_body(
        "Tell me a long story")["messages"]}).json()["count"]
    assert (row.status, row.prompt_tokens) == ("disconnected", prompt_tokens)
    # A gateway knows what its replica reported last: every PROGRESS_EVERY_TOKENS tokens.
    assert generated - PROGRESS_EVERY_TOKENS <= row.completion_tokens < 400
    assert server.idle_stats().num_used_blocks == 0  # the generation was aborted


def test_usage_endpoint_groups_totals_and_prices_them_and_keys_see_only_their_own(server: PlatformServer) -> None:
    _, admin = server.new_key("admin", admin=True)
    _, carol = server.new_key("carol")
    _, dave = server.new_key("dave")
    usages = {}
    for name, secret, n in (("carol", carol, 2), ("dave", dave, 1)):
        with server.client(secret) as client:
            usages[name] = [
                client.post("/v1/chat/completions", json=chat_body(max_tokens=3 + i)).json()["usage"] for i in range(n)
            ]
    server.wait_for_usage_rows(3)

    def totals(usages_list: list[dict]) -> dict:
        prompt = sum(u["prompt_tokens"] for u in usages_list)
        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages_list)
        output = sum(u["completion_tokens"] for u in usages_list)
        cost = ((prompt - cached) * 2.0 + cached * 1.0 + output * 8.0) / 1e6
        return {"requests": len(usages_list), "input_tokens": prompt, "output_tokens": output,
                "cached_tokens": cached, "cost_usd": cost}

    with server.client(carol) as client:
        own = client.get("/v1/usage", params={"group_by": "model"}).json()
    expected = totals(usages["carol"])
    assert [g["group"] for g in own["data"]] == [MODEL]
    for field_name, value in expected.items():
        assert own["total"][field_name] == pytest.approx(value)
    with server.client(admin) as client:
        everyone = client.get("/v1/usage", params={"group_by": "key"}).json()
        by_day = client.get("/v1/usage", params={"group_by": "day"}).json()
        empty = client.get("/v1/usage", params={"start": "2000-01-01", "end": "2000-01-02"}).json()
        bad = client.get("/v1/usage", params={"start": "yesterday"})
        bad_group = client.get("/v1/usage", params={"group_by": "colour"})
    assert everyone["total"]["requests"] == 3 and len(everyone["data"]) == 2
    assert by_day["total"]["output_tokens"] == totals(usages["carol"] + usages["dave"])["output_tokens"]
    assert len(by_day["data"]) == 1
    assert empty["total"]["requests"] == 0
    assert bad.status_code == 400 and error_of(bad)["param"] == "start"
    assert bad_group.status_code == 400 and error_of(bad_group)["param"] == "group_by"


# ---- conversations ---------------------------------------------------------------------------------


def test_a_conversation_keeps_its_turns_reuses_their_kv_and_belongs_to_its_key(server: PlatformServer) -> None:
    _, erin = server.new_key("erin")
    _, frank = server.new_key("frank")
    with server.client(erin) as client:
        created = client.post("/v1/conversations", json={"title": "Trip"})
        assert created.status_code == 201
        conversation_id = created.json()["id"]
        first = client.post("/v1/chat/completions", json=chat_body(
            "Plan a long weekend trip to the mountains with a friend, please, and mind the weather there.",
            max_tokens=8, conversation_id=conversation_id))
        second = client.post("/v1/chat/completions", json=chat_body(
            "And what should we pack?", max_tokens=8, conversation_id=conversation_id))
        stored = client.get(f"/v1/conversations/{conversation_id}/messages", params={"order": "asc"}).json()
        listing = client.get("/v1/conversations").json()
    assert first.status_code == second.status_code == 200
    assert first.headers["x-conversation-id"] == conversation_id
    assert [m["role"] for m in stored["data"]] == ["user", "assistant", "user", "assistant"]
    assert stored["data"][1]["content"] == first.json()["choices"][0]["message"]["content"]
    assert stored["data"][3]["token_count"] == second.json()["usage"]["completion_tokens"]
    # The second turn's prompt starts with the first turn's (history, then the new message).
    first_prompt = first.json()["usage"]["prompt_tokens"]
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (first_prompt // 16) * 16 > 0
    assert [c["id"] for c in listing["data"]] == [conversation_id] and "messages" not in listing["data"][0]
    with server.client(frank) as other:
        assert other.get(f"/v1/conversations/{conversation_id}").status_code == 404
        foreign = other.post("/v1/chat/completions", json=chat_body(conversation_id=conversation_id))
        assert other.get("/v1/conversations").json()["data"] == []
    assert foreign.status_code == 404 and error_of(foreign)["param"] == "conversation_id"
    with server.client(erin) as client:
        assert client.delete(f"/v1/conversations/{conversation_id}").status_code == 200
        assert client.get(f"/v1/conversations/{conversation_id}").status_code == 404
        assert client.get("/v1/conversations").json()["data"] == []
        gone = client.post("/v1/chat/completions", json=chat_body(conversation_id=conversation_id))
    assert gone.status_code == 404


def test_regenerating_from_an_earlier_message_branches_the_conversation(server: PlatformServer) -> None:
    with server.client() as client:
        conversation_id = client.post("/v1/conversations", json={}).json()["id"]
        client.post("/v1/chat/completions", json=chat_body("First question", conversation_id=conversation_id))
        client.post("/v1/chat/completions", json=chat_body("Second question", conversation_id=conversation_id))
        before = client.get(f"/v1/conversations/{conversation_id}/messages?order=asc").json()["data"]
        first_reply = before[1]["id"]
        branched = client.post("/v1/chat/completions", json=chat_body(
            "A different second question", conversation_id=conversation_id, parent_message_id=first_reply))
        after = client.get(f"/v1/conversations/{conversation_id}/messages?order=asc").json()["data"]
        stranger = client.post("/v1/chat/completions", json=chat_body(
            "x", conversation_id=conversation_id, parent_message_id="msg_unknown"))
        unknown = client.post("/v1/chat/completions", json=chat_body(conversation_id="conv_unknown"))
    assert branched.status_code == 200
    assert [m["content"] for m in after[:2]] == [before[0]["content"], before[1]["content"]]
    assert after[2]["content"] == "A different second question" and after[2]["parent_id"] == first_reply
    assert len(after) == 4
    assert stranger.status_code == 400 and error_of(stranger)["param"] == "parent_message_id"
    assert unknown.status_code == 404 and error_of(unknown)["code"] == "conversation_not_found"


# ---- safety ----------------------------------------------------------------------------------------


def test_a_blocked_prompt_is_a_400_before_any_engine_work(server: PlatformServer) -> None:
    server.platform.safety = RuleSetFilter(words=["forbidden"])
    before = server.engine.last_stats.num_running
    with server.client() as client:
        response = client.post("/v1/chat/completions", json=chat_body("tell me the Forbidden thing"))
        completion = client.post("/v1/completions", json={"model": MODEL, "prompt": "forbidden", "max_tokens": 2})
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["param"]) == ("content_filter", "messages")
    assert completion.status_code == 400 and error_of(completion)["param"] == "prompt"
    assert server.engine.last_stats.num_running == before
    assert server.count_usage_rows() == 0
    assert metric_value(server.base_url, "llmserve:safety_blocks_total", {"stage": "prompt"}) == 2


def _reference_reply(server: PlatformServer, body: dict) -> str:
    with server.client() as client:
        return client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]


def _blockable_word(text: str) -> tuple[str, int]:
    """A whole word of at least 3 letters past the start of `text`, and where it first appears."""
    import re

    for match in re.finditer(r"\b[A-Za-z]{3,}\b", text):
        if match.start() >= 8:
            return match.group(), re.search(rf"\b{match.group()}\b", text, re.IGNORECASE).start()
    pytest.skip("the reference reply has no usable word")


@pytest.mark.parametrize("screened", [False, True])
def test_include_obfuscation_pads_each_chunk_the_client_gets(server: PlatformServer, screened: bool) -> None:
    if screened:  # the gateway's screen rewrites the chunks: it pads them again
        server.platform.safety = RuleSetFilter(words=["zebrafinch"])
    # 48 tokens: the screen holds 32 characters back. A loaded machine may coalesce all of them into one chunk
    # after the role's, so the chunks padded are at least those two, of different sizes.
    body = chat_body("Tell me a story.", max_tokens=48, ignore_eos=True, temperature=0, stream=True,
                     stream_options={"include_obfuscation": True})
    with server.client() as client, client.stream("POST", "/v1/chat/completions", json=body) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: {")]
    assert len(events) >= 2 and json.loads(events[-1][6:])["choices"][0]["finish_reason"] == "length"
    for event in events:
        assert len(f"{event}\n\n".encode()) % 64 == 0 and json.loads(event[6:])["obfuscation"], event


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_a_model_that_is_not_a_string_is_a_400_naming_it(server: PlatformServer, path: str) -> None:
    body = {"prompt": "hi"} if path == "/tokenize" else {"tokens": [1, 2]}
    with server.client() as client:
        for model in ({}, [MODEL], 7):
            response = client.post(path, json={**body, "model": model})
            assert response.status_code == 400 and response.json()["error"]["param"] == "model", response.text
        assert client.post(path, json={**body, "model": MODEL}).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_blocked_output_stops_with_content_filter_and_withholds_the_text(
    server: PlatformServer, stream: bool
) -> None:
    # 400 tokens: the block comes early, so the engine is still generating when its abort arrives, even where a
    # loaded machine's API process reads the stream late
    body = chat_body("Write a long story about a cat.", max_tokens=400, ignore_eos=True, temperature=0)
    reference = _reference_reply(server, body)
    word, position = _blockable_word(reference)
    server.platform.safety = RuleSetFilter(words=[word])
    aborted = server.engine.num_aborted
    body["store"] = True  # kept as its client got it
    with server.client() as client:
        if stream:
            text, reasons = "", []
            with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        text += choice["delta"].get("content") or ""
                        reasons.append(choice["finish_reason"])
            finish_reason = reasons[-1]
            assert [r for r in reasons if r is not None] == ["content_filter"]
        else:
            choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
            text, finish_reason = choice["message"]["content"], choice["finish_reason"]
        [stored] = client.get("/v1/chat/completions").json()["data"]
    assert stored["choices"][0]["message"]["content"] == text
    assert stored["choices"][0]["finish_reason"] == finish_reason == "content_filter"
    assert word.lower() not in text.lower()
    assert reference.startswith(text) and len(text) <= position
    [row] = [r for r in server.wait_for_usage_rows(2) if r.status == "content_filter"]
    assert metric_value(server.base_url, "llmserve:safety_blocks_total", {"stage": "output"}) == 1
    if stream:  # the generation stopped there (behind a gateway: its replica stream was closed)
        assert server.wait_until(lambda: server.engine.num_aborted > aborted)


def _text_and_logprob_ids(
    server: PlatformServer, path: str, body: dict, stream: bool, field: str = "logprobs"
) -> tuple[str, list[int]]:
    """Choice 0's text and the ids of its tokens, from a chat or completions reply, whole or streamed:
    those its logprobs name (`return_tokens_as_token_ids`), or with `field="token_ids"` its
    `return_token_ids`."""
    chat = path.endswith("/chat/completions")

    def text_of(choice: dict, part: str) -> str:
        return (choice[part].get("content") or "") if chat else choice["text"]

    def tokens_of(choice: dict) -> list[str]:
        if field == "token_ids":
            return [f"token_id:{token_id}" for token_id in choice.get("token_ids") or []]
        logprobs = choice["logprobs"] or {}
        return [entry["token"] for entry in logprobs.get("content") or []] if chat else logprobs.get("tokens", [])

    with server.client() as client:
        if stream:
            choices = []
            with client.stream("POST", path, json={**body, "stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {") and (chunk := json.loads(line[6:])["choices"]):
                        choices.append(chunk[0])
            text = "".join(text_of(choice, "delta") for choice in choices)
            tokens = [token for choice in choices for token in tokens_of(choice)]
        else:
            choice = client.post(path, json=body).json()["choices"][0]
            text, tokens = text_of(choice, "message"), tokens_of(choice)
    return text, [int(token.removeprefix("token_id:")) for token in tokens]


@pytest.mark.parametrize("stream", [False, True])
def test_a_blocked_output_shows_no_logprob_of_the_text_it_withholds(server: PlatformServer, stream: bool) -> None:
    body = chat_body("Write a long story about a cat.", max_tokens=60, ignore_eos=True, temperature=0,
                     logprobs=True, return_tokens_as_token_ids=True)
    reference = _reference_reply(server, body)
    word, _ = _blockable_word(reference)
    server.platform.safety = RuleSetFilter(words=[word])
    text, ids = _text_and_logprob_ids(server, "/v1/chat/completions", body, stream)
    shown = server.engine.tokenizer.decode(ids)
    # The logprobs are those of the text shown, and nothing past it.
    assert text.startswith(shown) and word.lower() not in shown.lower()
    if not stream and not hasattr(server.app.state, "gateway"):
        # The server maps its tokens to the text they made: all of the text shown but a token whose
        # character is not whole. A gateway sees text and logprobs, not how they align: a reply it
        # blocks whole goes out without logprobs.
        assert len(shown) >= len(text) - 2 and text


@pytest.mark.parametrize("stream", [False, True])
def test_a_blocked_output_shows_no_token_id_of_the_text_it_withholds(server: PlatformServer, stream: bool) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True, "temperature": 0,
            "return_token_ids": True}
    with server.client() as client:
        reference = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    word, _ = _blockable_word(reference)
    server.platform.safety = RuleSetFilter(words=[word])
    text, ids = _text_and_logprob_ids(server, "/v1/completions", body, stream, field="token_ids")
    shown = server.engine.tokenizer.decode(ids)
    assert text.startswith(shown) and word.lower() not in shown.lower() and word.lower() not in text.lower()


@pytest.mark.parametrize("stream", [False, True])
def test_a_screened_output_that_passes_keeps_every_logprob(server: PlatformServer, stream: bool) -> None:
    server.platform.safety = RuleSetFilter(words=["zebrafinch"])  # screened, never matched
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True, "temperature": 0,
            "logprobs": 1, "return_tokens_as_token_ids": True}
    text, ids = _text_and_logprob_ids(server, "/v1/completions", body, stream)
    assert len(ids) == 40 and server.engine.tokenizer.decode(ids) == text


def test_a_blocked_completion_stream_stops_with_content_filter(server: PlatformServer) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    with server.client() as client:
        reference = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    word, position = _blockable_word(reference)
    server.platform.safety = RuleSetFilter(words=[word])
    text, reasons = "", []
    with server.client() as client, client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                reasons.append(choice["finish_reason"])
    assert [r for r in reasons if r is not None] == ["content_filter"] and reasons[-1] == "content_filter"
    assert word.lower() not in text.lower() and reference.startswith(text) and len(text) <= position
    assert {r.status for r in server.wait_for_usage_rows(2)} == {"completed", "content_filter"}


# ---- several models ----------------------------------------------------------------------------------


def test_requests_route_by_name_alias_and_sticky_canary(tiny_engine: AsyncLLM, tmp_path: Path, mode: str) -> None:  # noqa: F811
    models = [ModelSpec("v1", tiny_engine), ModelSpec("v2", tiny_engine)]
    aliases = {"chat": [("v1", 0.5), ("v2", 0.5)], "mini": [("v1", 1.0)]}
    for server in serve_platform(tiny_engine, tmp_path, models=models, aliases=aliases, mode=mode):
        with server.client() as client:
            listed = [m["id"] for m in client.get("/v1/models").json()["data"]]
            assert listed == ["v1", "v2", "chat", "mini"]
            assert client.post("/v1/chat/completions", json=chat_body(model="mini")).json()["model"] == "v1"
            picks = {
                user: {client.post("/v1/chat/completions", json=chat_body(model="chat", user=user, max_tokens=1))
                       .json()["model"] for _ in range(3)}
                for user in ("u1", "u2", "u3", "u4", "u5", "u6")
            }
            unknown = client.post("/v1/chat/completions", json=chat_body(model="nope"))
        assert all(len(models_seen) == 1 for models_seen in picks.values())  # sticky per user
        assert set().union(*picks.values()) == {"v1", "v2"}  # both versions get traffic
        assert unknown.status_code == 404 and error_of(unknown)["code"] == "model_not_found"
        rows = server.wait_for_usage_rows(19)
        assert len(rows) == 19 and {r.model for r in rows} == {"v1", "v2"}  # metered as the model that ran


def test_a_loading_model_answers_503_until_it_is_ready(tiny_engine: AsyncLLM, tmp_path: Path) -> None:  # noqa: F811
    """(`llmserve serve` loads its models itself; a gateway's replicas are loaded before they are healthy.)"""
    release = threading.Event()

    def slow_load() -> AsyncLLM:
        release.wait(timeout=60)
        return tiny_engine

    models = [ModelSpec("v1", tiny_engine), ModelSpec("late", load=slow_load)]
    for server in serve_platform(tiny_engine, tmp_path, models=models):
        with server.client() as client:
            loading = client.post("/v1/chat/completions", json=chat_body(model="late"))
            health = client.get("/health")
            release.set()
            deadline = asyncio.run(_wait_until_ready(server))
            ready = client.post("/v1/chat/completions", json=chat_body(model="late"))
            unknown = client.post("/v1/chat/completions", json=chat_body(model="nope"))
        assert loading.status_code == 503 and error_of(loading)["code"] == "model_loading"
        assert int(loading.headers["retry-after"]) >= 1
        assert health.status_code == 503
        assert deadline and ready.status_code == 200 and ready.json()["model"] == "late"
        assert unknown.status_code == 404


async def _wait_until_ready(server: PlatformServer) -> bool:
    async with httpx.AsyncClient(base_url=server.base_url) as client:
        for _ in range(600):
            if (await client.get("/health")).status_code == 200:
                return True
            await asyncio.sleep(0.05)
    return False
