"""Prefill/decode disaggregation through the gateway (gateway/disaggregation.py).

Three layers: the rule and the options alone; the wire (what the prefill and decode replicas are sent,
what the gateway does with each answer, fallbacks, metrics, metering) against stub replicas that speak
the replicas' P/D contract; and real `llmserve serve` replicas of the tiny model: a plain one (the
reference answers, and a prefill replica without --kv-transfer, which answers the prefill call with a
400), and a prefill and a decode replica started with --kv-transfer, for the end-to-end tests."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from sqlalchemy import select

from llmserve.cli import build_parser
from llmserve.gateway.app import build_gateway_app
from llmserve.gateway.client import ReplicaClient
from llmserve.gateway.disaggregation import (
    SKIPPED_CACHED,
    SKIPPED_SHORT,
    DisaggregationOptions,
    Disaggregator,
    decode_body,
    prefill_body,
    transfer_of,
    transferable,
)
from llmserve.gateway.metrics import GatewayMetrics
from llmserve.gateway.pool import Pool
from llmserve.gateway.replica import Replica
from llmserve.gateway.routing import LeastLoadPolicy, PrefixPolicy
from llmserve.gateway.serve import parse_pools, parse_prefill_pools, platform_config
from llmserve.platform.keys import KeyCache, KeyStore
from llmserve.platform.usage import UsageRecorder
from llmserve.server.gateway import Platform
from llmserve.store.db import open_database
from llmserve.store.schema import UsageRecordRow
from tests.gateway.test_gateway import MODEL, STARTUP_TIMEOUT_S, Process, _events, _metric, _start, _stop
from tests.server.conftest import app_serving

MIN_CHARS = 200  # the gateways' --pd-min-prompt-chars here: the tiny model's context is 512 tokens
LONG = "Summarize the following notes about the history of the printing press in Europe. " * 4  # > MIN_CHARS
CHAT = "/v1/chat/completions"


def _chat(content: str, **extra: Any) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 6,
            "temperature": 0, **extra}


def _completion(prompt: str, **extra: Any) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, **extra}


def _outcomes(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics").text
    return {outcome: _metric(text, "llmserve:gateway_disaggregated_requests_total", pool=MODEL, outcome=outcome)
            for outcome in ("transferred", "prefill_failed", "no_prefill_replica", "skipped_short", "skipped_cached")}


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {outcome: count - before[outcome] for outcome, count in after.items() if count != before[outcome]}


@contextmanager
def _gateway(pools: dict[str, list[str]], prefill_pools: dict[str, list[str]], **options: Any) -> Iterator[str]:
    disaggregation = DisaggregationOptions(min_prompt_chars=MIN_CHARS, **options)
    app = build_gateway_app(pools, "prefix", prefill_pools=prefill_pools, disaggregation=disaggregation)
    with app_serving(app) as base_url:
        yield base_url


# ---- the rule and the options ------------------------------------------------------------------------

def _decision_pool() -> tuple[Pool, Disaggregator]:
    pool = Pool(MODEL, [Replica("http://decode-a"), Replica("http://decode-b")], PrefixPolicy())
    prefill = Pool(f"{MODEL}/prefill", [Replica("http://prefill")], LeastLoadPolicy())
    metrics = GatewayMetrics([pool, prefill])
    return pool, Disaggregator({MODEL: prefill}, ReplicaClient(), metrics, DisaggregationOptions(min_prompt_chars=1000))


def test_only_a_long_uncached_prompt_is_disaggregated() -> None:
    pool, disaggregator = _decision_pool()
    system = "You are a careful assistant who reads long documents. " * 60  # 3,300 characters

    def reason(prompt: str | list[int]) -> str | None:
        return disaggregator.skip_reason(prompt, pool.route(prompt))

    assert reason("Hello there") == SKIPPED_SHORT
    assert reason(system + "First question?") is None  # nothing of it cached anywhere
    # The next turn goes where the system prompt is cached, and only its last few characters are new there.
    assert reason(system + "Second question?") == SKIPPED_CACHED
    assert reason(system + "A long new document to read. " * 40) is None  # 1,160 new characters
    assert reason([7] * 300) is None  # token ids weigh about four characters each
    assert reason([7] * 200) == SKIPPED_SHORT


def test_what_the_replicas_are_sent() -> None:
    request = _chat("Hi", stream=True, stream_options={"include_usage": True}, n=2, max_completion_tokens=50,
                    min_tokens=3)
    prefill = prefill_body(request)
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True}
    assert (prefill["max_tokens"], prefill["stream"], prefill["n"]) == (1, False, 1)
    assert not {"stream_options", "max_completion_tokens", "min_tokens"} & set(prefill)
    assert prefill["messages"] == request["messages"]
    transfer = {"transfer_id": "ab12", "remote_host": "10.0.0.7", "remote_port": 5601}
    assert decode_body(request, transfer) == {**request, "kv_transfer_params": {"do_remote_prefill": True, **transfer}}
    assert "kv_transfer_params" not in request  # the client's body is left as it was

    answer = {"kv_transfer_params": {"transfer_id": "ab12", "remote_host": None, "remote_port": 5601, "num_tokens": 40}}
    assert transfer_of(json.dumps(answer).encode(), "http://10.0.0.7:8000") == transfer
    for broken in ({}, {"kv_transfer_params": {"transfer_id": "", "remote_port": 1}},
                   {"kv_transfer_params": {"transfer_id": "x", "remote_port": "5601"}},
                   {"kv_transfer_params": {"transfer_id": "x", "remote_port": True}}):
        assert transfer_of(json.dumps(broken).encode(), "http://h:1") is None
    assert transfer_of(b"not json", "http://h:1") is None


def test_which_requests_may_be_transferred() -> None:
    assert transferable(CHAT, _chat("x"))
    assert transferable("/v1/completions", _completion("x"))
    assert transferable("/v1/completions", _completion([1, 2, 3]))  # type: ignore[arg-type]
    assert not transferable("/v1/completions", _completion(["a", "b"]))  # type: ignore[arg-type]  # two prompts
    assert not transferable("/v1/completions", _completion("x", echo=True, logprobs=1))  # needs prompt logits
    assert not transferable(CHAT, _chat("x", prompt_logprobs=1))
    assert not transferable("/v1/embeddings", {"model": MODEL, "input": "x"})


def test_prefill_pools_from_flags_and_config(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(f"pools:\n  {MODEL}: [http://d1:8000]\nprefill_pools:\n  {MODEL}: [http://p1:8000]\n")
    pools = parse_pools(["other=http://d2:8000"], str(config))
    prefill = parse_prefill_pools([f"{MODEL}=dns+http://prefill-headless:8000,http://p2:8000"], str(config), pools)
    assert prefill == {MODEL: ["http://p1:8000", "dns+http://prefill-headless:8000", "http://p2:8000"]}
    assert platform_config(str(config)) is not None  # `prefill_pools` is not the platform's
    with pytest.raises(ValueError, match="not a pool"):
        parse_prefill_pools(["nope=http://p:1"], None, pools)
    with pytest.raises(ValueError, match="expected NAME=URL"):
        parse_prefill_pools([MODEL], None, pools)
    with pytest.raises(ValueError, match="not an http"):
        parse_prefill_pools([f"{MODEL}=p:1"], None, pools)
    with pytest.raises(ValueError, match="not a pool"):
        build_gateway_app({MODEL: ["http://d:1"]}, prefill_pools={"nope": ["http://p:1"]})

    args = build_parser().parse_args(["gateway", "--pool", f"{MODEL}=http://d:1", "--prefill-pool", f"{MODEL}=http://p:1"])
    assert (args.prefill_pool, args.pd_min_prompt_chars, args.pd_prefill_timeout) == ([f"{MODEL}=http://p:1"], 4096, 30.0)


# ---- the wire, against stub replicas ------------------------------------------------------------------

USAGE = {"prompt_tokens": 50, "completion_tokens": 3, "total_tokens": 53}


@dataclass
class Stub:
    """A replica's HTTP face speaking the P/D contract: answers a prefill call with `prefill_status` (and
    its transfer, when 200), anything else with a fixed chat completion, and keeps every body it got."""

    prefill_status: int = 200
    prefill_port: int | None = 5601
    bodies: list[dict] = field(default_factory=list)
    hung: bool = False  # prefill calls are answered only once their caller gave up on them

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict:
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics() -> PlainTextResponse:
            return PlainTextResponse("")

        @app.post(CHAT)
        async def chat(request: Request) -> Response:
            body = await request.json()
            self.bodies.append(body)
            if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
                return await self._prefill(request)
            return _chat_answer(body.get("stream", False))

        return app

    async def _prefill(self, request: Request) -> Response:
        while self.hung and not await request.is_disconnected():
            await asyncio.sleep(0.02)
        if self.prefill_status != 200:
            return JSONResponse({"error": {"message": "no", "type": "invalid_request_error",
                                           "param": "kv_transfer_params", "code": None}}, self.prefill_status)
        params = {"transfer_id": "0f1e", "remote_host": None, "remote_port": self.prefill_port, "num_tokens": 48}
        return JSONResponse({"id": "chatcmpl-p", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 50, "completion_tokens": 1, "total_tokens": 51}, "kv_transfer_params": params})


def _chat_answer(stream: bool) -> Response:
    if not stream:
        return JSONResponse({"id": "chatcmpl-d", "object": "chat.completion", "created": 0, "model": MODEL,
                             "choices": [{"index": 0, "message": {"role": "assistant", "content": "abc"},
                                          "finish_reason": "length"}], "usage": USAGE})

    async def events() -> Any:
        for text in ("a", "bc"):
            chunk = {"id": "chatcmpl-d", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                     "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n"
        yield f'data: {json.dumps({"id": "chatcmpl-d", "object": "chat.completion.chunk", "choices": [], "usage": USAGE})}\n\n'
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@contextmanager
def _stubs(prefill: Stub, decode: Stub, **options: Any) -> Iterator[str]:
    with ExitStack() as stack:
        prefill_url, decode_url = (stack.enter_context(app_serving(stub.app())) for stub in (prefill, decode))
        yield stack.enter_context(_gateway({MODEL: [decode_url]}, {MODEL: [prefill_url]}, **options))


def test_a_long_prompt_is_prefilled_on_the_prefill_replica_then_decoded_with_its_transfer() -> None:
    prefill, decode = Stub(), Stub()
    with _stubs(prefill, decode) as gateway:
        answer = httpx.post(f"{gateway}{CHAT}", json=_chat(LONG, stream=True, stream_options={"include_usage": True}),
                            headers={"Accept-Encoding": "gzip"}, timeout=30)
        short = httpx.post(f"{gateway}{CHAT}", json=_chat("Hi"), timeout=30)
        metrics = httpx.get(f"{gateway}/metrics").text
    assert answer.status_code == 200 and _events(answer.text)[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in _events(answer.text)[:2]) == "abc"
    assert short.status_code == 200 and short.json()["choices"][0]["message"]["content"] == "abc"
    [prefill_call] = prefill.bodies
    assert prefill_call["kv_transfer_params"] == {"do_remote_decode": True}
    assert (prefill_call["max_tokens"], prefill_call["stream"], prefill_call["n"]) == (1, False, 1)
    assert "stream_options" not in prefill_call
    decode_call, short_call = decode.bodies
    # The replica did not know its address: the host of its URL goes in its place.
    assert decode_call["kv_transfer_params"] == {"do_remote_prefill": True, "transfer_id": "0f1e",
                                                 "remote_host": "127.0.0.1", "remote_port": 5601}
    assert {k: v for k, v in decode_call.items() if k != "kv_transfer_params"} == _chat(
        LONG, stream=True, stream_options={"include_usage": True})
    assert "kv_transfer_params" not in short_call
    assert _metric(metrics, "llmserve:gateway_disaggregated_requests_total", pool=MODEL, outcome="transferred") == 1
    assert _metric(metrics, "llmserve:gateway_disaggregated_requests_total", pool=MODEL, outcome="skipped_short") == 1
    assert _metric(metrics, "llmserve:gateway_prefill_seconds_count", pool=MODEL) == 1
    assert _metric(metrics, "llmserve:gateway_requests_total", pool=f"{MODEL}/prefill") == 1


@pytest.mark.parametrize(("prefill", "outcome"), [
    (Stub(prefill_status=400), "prefill_failed"),  # a replica without --kv-transfer
    (Stub(prefill_status=500), "prefill_failed"),
    (Stub(prefill_port=None), "prefill_failed"),  # an answer without a usable transfer
    (Stub(hung=True), "prefill_failed"),  # no answer within the prefill timeout
])
def test_a_failed_prefill_call_sends_the_request_to_its_decode_replica_as_it_is(prefill: Stub, outcome: str) -> None:
    decode = Stub()
    with _stubs(prefill, decode, prefill_timeout_s=0.5) as gateway:
        answers = [httpx.post(f"{gateway}{CHAT}", json=_chat(tail + LONG, stream=stream), timeout=30)
                   for tail, stream in (("one", False), ("two", True))]
        counted = _outcomes(gateway)
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[0].json()["choices"][0]["message"]["content"] == "abc"
    assert _events(answers[1].text)[-1] == "[DONE]"
    assert len(decode.bodies) == 2 and all("kv_transfer_params" not in body for body in decode.bodies)
    assert counted[outcome] == 2 and counted["transferred"] == 0


def test_without_a_healthy_prefill_replica_the_decode_replica_computes_the_prompt() -> None:
    decode = Stub()
    with ExitStack() as stack:
        decode_url = stack.enter_context(app_serving(decode.app()))
        gateway = stack.enter_context(_gateway({MODEL: [decode_url]}, {MODEL: ["http://127.0.0.1:9"]}))
        answer = httpx.post(f"{gateway}{CHAT}", json=_chat(LONG), timeout=30)
        counted = _outcomes(gateway)
        metrics = httpx.get(f"{gateway}/metrics").text
    assert answer.status_code == 200 and "kv_transfer_params" not in decode.bodies[0]
    assert counted["no_prefill_replica"] == 1
    assert _metric(metrics, "llmserve:gateway_replica_healthy", pool=f"{MODEL}/prefill") == 0


def test_a_client_may_not_send_kv_transfer_params(tmp_path: Path) -> None:
    decode = Stub()
    with ExitStack() as stack:
        decode_url = stack.enter_context(app_serving(decode.app()))
        plain = stack.enter_context(_gateway({MODEL: [decode_url]}, {}))
        database = open_database(f"sqlite:///{tmp_path / 'platform.db'}")
        platform = Platform(keys=KeyCache(KeyStore(database)), database=database)
        with_platform = stack.enter_context(app_serving(build_gateway_app({MODEL: [decode_url]}, platform=platform)))
        stolen = {"do_remote_prefill": True, "transfer_id": "0f1e", "remote_host": "10.0.0.1", "remote_port": 1}
        answers = [httpx.post(f"{url}{path}", json={**body, "kv_transfer_params": stolen}, timeout=30)
                   for url in (plain, with_platform)
                   for path, body in ((CHAT, _chat("Hi")), ("/v1/completions", _completion("Hi")))]
    for answer in answers:
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "kv_transfer_params" and error["type"] == "invalid_request_error"
    assert decode.bodies == []


def test_the_platform_meters_the_decode_answer_only(tmp_path: Path) -> None:
    prefill, decode = Stub(), Stub()
    database = open_database(f"sqlite:///{tmp_path / 'platform.db'}")
    platform = Platform(keys=KeyCache(KeyStore(database)), usage=UsageRecorder(database, flush_interval=0.2),
                        database=database)
    disaggregation = DisaggregationOptions(min_prompt_chars=MIN_CHARS)
    with ExitStack() as stack:
        prefill_url, decode_url = (stack.enter_context(app_serving(stub.app())) for stub in (prefill, decode))
        gateway = stack.enter_context(app_serving(build_gateway_app(
            {MODEL: [decode_url]}, platform=platform, prefill_pools={MODEL: [prefill_url]},
            disaggregation=disaggregation)))
        answers = [httpx.post(f"{gateway}{CHAT}", json=_chat(tail + LONG, stream=stream), timeout=30)
                   for tail, stream in (("one", False), ("two", True))]
        counted = _outcomes(gateway)
        platform.usage.flush()
        with database.session() as session:
            rows = list(session.scalars(select(UsageRecordRow)))
    database.dispose()
    assert [a.status_code for a in answers] == [200, 200]
    assert counted["transferred"] == 2 and len(prefill.bodies) == 2
    assert all(body["kv_transfer_params"]["do_remote_prefill"] for body in decode.bodies)
    # Two requests, each metered once, with the decode replica's usage (the prefill call's 50 + 1 never).
    assert sorted((r.status, r.prompt_tokens, r.completion_tokens) for r in rows) == [("completed", 50, 3)] * 2


# ---- real replicas ---------------------------------------------------------------------------------

def _replica_command(model_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "llmserve.cli", "serve", "--model", str(model_dir), "--served-model-name", MODEL,
            "--no-platform", "--port", "0", "--num-kv-blocks", "128", "--max-model-len", "512", *extra]


@contextmanager
def _replicas(commands: list[list[str]]) -> Iterator[list[Process]]:
    """Replicas started side by side; their processes (a failure names the first that did not start)."""
    started = [_start(command, r"serving \S+ at (http://\S+)/v1") for command in commands]
    try:
        for command, (proc, ready, _) in zip(commands, started, strict=True):
            assert ready.wait(STARTUP_TIMEOUT_S) and proc.poll() is None, (
                f"a replica did not start: llmserve serve {' '.join(command[5:])}")
        yield [Process(proc, found[0]) for proc, _, found in started]
    finally:
        for proc, _, _ in started:
            _stop(proc)


@pytest.fixture(scope="module")
def plain_replica(tiny_llama_dir: Path) -> Iterator[Process]:
    """A replica without --kv-transfer: the reference answers, and a prefill replica that answers 400."""
    with _replicas([_replica_command(tiny_llama_dir)]) as (replica,):
        yield replica


@dataclass
class PD:
    prefill: Process
    decode: Process
    gateway: str


@pytest.fixture(scope="module")
def pd(tiny_llama_dir: Path) -> Iterator[PD]:
    """A prefill and a decode replica started with --kv-transfer, behind a gateway."""
    command = _replica_command(tiny_llama_dir, "--kv-transfer")
    with _replicas([command, command]) as (prefill, decode):
        probe = httpx.post(f"{prefill.url}{CHAT}", json={**_chat(LONG, max_tokens=1),
                                                         "kv_transfer_params": {"do_remote_decode": True}}, timeout=60)
        assert probe.status_code == 200 and "kv_transfer_params" in probe.json(), probe.text
        with _gateway({MODEL: [decode.url]}, {MODEL: [prefill.url]}) as gateway:
            yield PD(prefill, decode, gateway)


def _answer(base_url: str, path: str, body: dict) -> str:
    """The answer's text: a non-streamed one's, or a stream's joined (which must end with [DONE])."""
    response = httpx.post(f"{base_url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    if not body.get("stream"):
        choice = response.json()["choices"][0]
        return choice["message"]["content"] if path == CHAT else choice["text"]
    events = _events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert all("error" not in chunk for chunk in chunks)
    return "".join((c["choices"][0]["delta"].get("content") or "") if path == CHAT else c["choices"][0]["text"]
                   for c in chunks if c["choices"])


def test_a_prefill_replica_without_kv_transfer_or_down_costs_the_answer_nothing(plain_replica: Process) -> None:
    cases = [(CHAT, _chat("In French: " + LONG)), ("/v1/completions", _completion("Once upon a time. " + LONG))]
    with _gateway({MODEL: [plain_replica.url]}, {MODEL: [plain_replica.url]}) as answering_400:
        got = [_answer(answering_400, path, body) for path, body in cases]
        assert _outcomes(answering_400)["prefill_failed"] == 2
    with _gateway({MODEL: [plain_replica.url]}, {MODEL: ["http://127.0.0.1:9"]}) as down:
        got += [_answer(down, path, {**body, "stream": True}) for path, body in cases]
        assert _outcomes(down)["no_prefill_replica"] == 2
    want = [_answer(plain_replica.url, path, body) for path, body in cases]
    assert got == want * 2


def test_greedy_answers_through_prefill_and_decode_replicas_equal_a_plain_replicas(
    pd: PD, plain_replica: Process
) -> None:
    def blocks(replica: Process, direction: str) -> float:
        text = httpx.get(f"{replica.url}/metrics").text
        return _metric(text, "llmserve:kv_transfer_blocks_total", direction=direction)

    def prompt_tokens(replica: Process) -> float:
        return _metric(httpx.get(f"{replica.url}/metrics").text, "vllm:prompt_tokens_total")

    # Each its own prompt: none is cached on the decode replica before.
    cases = [(CHAT, _chat(f"Case {n}. {LONG}Tell me about Gutenberg.", stream=n == 1)) for n in (0, 1)]
    cases += [("/v1/completions", _completion(f"Case {n}. {LONG}In the year 1450", stream=n == 3)) for n in (2, 3)]
    before = _outcomes(pd.gateway)
    sent, received, prefilled = blocks(pd.prefill, "sent"), blocks(pd.decode, "received"), prompt_tokens(pd.prefill)
    got = [_answer(pd.gateway, path, body) for path, body in cases]
    assert _delta(before, _outcomes(pd.gateway)) == {"transferred": len(cases)}
    assert prompt_tokens(pd.prefill) - prefilled >= len(cases) * len(LONG) // 8  # it computed the prompts
    assert blocks(pd.prefill, "sent") > sent and blocks(pd.decode, "received") > received
    assert got == [_answer(plain_replica.url, path, body) for path, body in cases]


def test_a_short_prompt_is_not_disaggregated(pd: PD, plain_replica: Process) -> None:
    before, received = _outcomes(pd.gateway), httpx.get(f"{pd.decode.url}/metrics").text
    body = _chat("Hello there, how are you?")
    assert _answer(pd.gateway, CHAT, body) == _answer(plain_replica.url, CHAT, body)
    assert _delta(before, _outcomes(pd.gateway)) == {"skipped_short": 1}
    after = httpx.get(f"{pd.decode.url}/metrics").text
    assert (_metric(after, "llmserve:kv_transfer_blocks_total", direction="received")
            == _metric(received, "llmserve:kv_transfer_blocks_total", direction="received"))


def test_a_killed_prefill_replica_makes_requests_fall_back(pd: PD, plain_replica: Process) -> None:
    """Last of the module: the prefill replica does not come back."""
    pd.prefill.proc.send_signal(signal.SIGKILL)
    pd.prefill.proc.wait(timeout=10)
    before = _outcomes(pd.gateway)
    cases = [(CHAT, _chat(f"Killed {n}. {LONG}", stream=n == 1)) for n in range(3)]
    got = [_answer(pd.gateway, path, body) for path, body in cases]
    assert got == [_answer(plain_replica.url, path, body) for path, body in cases]
    fell_back = _delta(before, _outcomes(pd.gateway))
    # The first finds the dead replica (refused: ejected at once), the others none healthy.
    assert set(fell_back) <= {"prefill_failed", "no_prefill_replica"} and sum(fell_back.values()) == 3
