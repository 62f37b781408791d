"""The gateway in front of three real `llmserve serve --no-platform` replicas of the tiny model: prefix
affinity, responses passed through unchanged, errors in OpenAI's shape, the CLI, and `kill -9` of a
replica under load (retries, broken streams ending with an error event, ejection within 2 s)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from llmserve.gateway.app import build_gateway_app
from llmserve.gateway.proxy import prompt_key
from llmserve.gateway.replica import ReplicaState
from llmserve.server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES

MODEL = "tiny"
STARTUP_TIMEOUT_S = 120.0


@dataclass
class Process:
    proc: subprocess.Popen
    url: str


def _wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def _start(command: list[str], pattern: str) -> tuple[subprocess.Popen, threading.Event, list[str]]:
    """Start a process and, on a thread, read its output until a line matches `pattern` (then drain it)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            match = re.search(pattern, line)
            if match and not ready.is_set():
                found.append(match.group(1))
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    return proc, ready, found


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir: Path) -> Iterator[list[Process]]:
    """Three replicas started side by side."""
    command = [
        sys.executable, "-m", "llmserve.cli", "serve", "--model", str(tiny_llama_dir), "--served-model-name",
        MODEL, "--no-platform", "--port", "0", "--num-kv-blocks", "256", "--max-model-len", "512",
    ]
    started = [_start(command, r"serving \S+ at (http://\S+)/v1") for _ in range(3)]
    try:
        for proc, ready, _ in started:
            assert ready.wait(STARTUP_TIMEOUT_S), "a replica did not start"
            assert proc.poll() is None
        yield [Process(proc, found[0]) for proc, _, found in started]
    finally:
        for proc, _, _ in started:
            _stop(proc)


@dataclass
class Gateway:
    url: str
    app: object

    @property
    def pool(self):
        return self.app.state.gateway.pools[MODEL]


@pytest.fixture(scope="module")
def gateway(replicas: list[Process]) -> Iterator[Gateway]:
    """The gateway app in process (its pools can be looked at directly), on a free port."""
    app = build_gateway_app({MODEL: [r.url for r in replicas]}, "prefix")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        _wait_until(lambda: server.started, 10, "the gateway to listen")
        port = server.servers[0].sockets[0].getsockname()[1]
        yield Gateway(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _metric(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include `labels` (0 when there are none)."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(r"([^{\s]+)(?:\{(.*)\})? (\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(key) == value for key, value in labels.items()):
            total += float(match.group(3))
    return total


def _requests_by_replica(gateway: Gateway, replicas: list[Process]) -> dict[str, float]:
    text = httpx.get(f"{gateway.url}/metrics").text
    return {r.url: _metric(text, "llmserve:gateway_requests_total", replica=r.url) for r in replicas}


def _chat(content: str, system: str | None = None, **extra: object) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, **extra}


def _events(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def test_requests_sharing_a_system_prompt_land_on_one_replica(gateway: Gateway, replicas: list[Process]) -> None:
    systems = [f"You are assistant number {n}. " + "Answer briefly and politely, citing sources. " * 8
               for n in (1, 2)]
    before = _requests_by_replica(gateway, replicas)
    chosen = []
    for system in systems:
        for turn in range(4):
            response = httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat(f"question {turn}", system),
                                  timeout=30)
            assert response.status_code == 200, response.text
            after = _requests_by_replica(gateway, replicas)
            chosen.append(next(url for url in after if after[url] - before[url] == 1))
            before = after
    assert len(set(chosen[:4])) == 1 and len(set(chosen[4:])) == 1, chosen
    assert chosen[0] != chosen[4], "a new system prompt goes to the replica with the least cached"
    text = httpx.get(f"{gateway.url}/metrics").text
    assert _metric(text, "llmserve:gateway_routing_decisions_total", pool=MODEL, reason="prefix_hit") >= 6


def test_a_prompt_cache_key_keeps_short_prompts_on_one_replica(gateway: Gateway, replicas: list[Process]) -> None:
    def hits() -> float:
        text = httpx.get(f"{gateway.url}/metrics").text
        return _metric(text, "llmserve:gateway_routing_decisions_total", pool=MODEL, reason="prefix_hit")

    before, hits_before = _requests_by_replica(gateway, replicas), hits()
    chosen: dict[str, list[str]] = {"tenant-a": [], "tenant-b": []}
    for turn in range(3):
        for key, urls in chosen.items():
            # shorter than a block; salted, to leave the replicas' caches as the other tests expect them
            body = {**_chat(f"hi {turn}", max_tokens=2), "prompt_cache_key": key, "cache_salt": "cache-key-test"}
            assert httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=30).status_code == 200
            after = _requests_by_replica(gateway, replicas)
            urls.append(next(url for url in after if after[url] - before[url] == 1))
            before = after
    assert [len(set(urls)) for urls in chosen.values()] == [1, 1], chosen
    # Each key's later turns matched its first (a prompt without a full block and without a key has
    # nothing to match: a miss every time).
    assert hits() - hits_before == 4


def test_responses_pass_through_unchanged(gateway: Gateway, replicas: list[Process]) -> None:
    body = _chat("Tell me a story.", max_tokens=8)
    direct = httpx.post(f"{replicas[0].url}/v1/chat/completions", json=body, timeout=30)
    proxied = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=30)
    assert proxied.status_code == direct.status_code == 200
    assert proxied.headers["content-type"] == direct.headers["content-type"]
    got, want = proxied.json(), direct.json()
    assert got.keys() == want.keys() and got["object"] == "chat.completion"
    assert got["choices"] == want["choices"] and got["usage"] == want["usage"]

    stream = {**body, "stream": True}
    direct = httpx.post(f"{replicas[0].url}/v1/chat/completions", json=stream, timeout=30)
    proxied = httpx.post(f"{gateway.url}/v1/chat/completions", json=stream, timeout=30)
    assert proxied.headers["content-type"].startswith("text/event-stream")
    got_events, want_events = _events(proxied.text), _events(direct.text)
    assert got_events[-1] == want_events[-1] == "[DONE]"
    got_chunks = [json.loads(event) for event in got_events[:-1]]
    want_chunks = [json.loads(event) for event in want_events[:-1]]
    # How tokens are grouped into chunks depends on the replica's steps; the chunks' shape and text do not.
    assert {tuple(chunk) for chunk in got_chunks} == {tuple(chunk) for chunk in want_chunks}
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in got_chunks)

    def text(chunks: list[dict]) -> str:
        return "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"])

    assert text(got_chunks) == text(want_chunks) == got["choices"][0]["message"]["content"]
    assert got_chunks[-1]["choices"][0]["finish_reason"] == "length"

    completion = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}
    proxied = httpx.post(f"{gateway.url}/v1/completions", json=completion, timeout=30)
    direct = httpx.post(f"{replicas[1].url}/v1/completions", json=completion, timeout=30)
    assert proxied.status_code == 200 and proxied.json()["choices"] == direct.json()["choices"]

    response = {"model": MODEL, "instructions": "Be brief.", "temperature": 0, "max_output_tokens": 5,
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "Once upon a time"}]}]}
    proxied = httpx.post(f"{gateway.url}/v1/responses", json=response, timeout=30)
    direct = httpx.post(f"{replicas[1].url}/v1/responses", json=response, timeout=30)
    assert proxied.status_code == 200 and proxied.json()["output"][0]["content"] == direct.json()["output"][0]["content"]
    assert prompt_key(response) == "Be brief.\nOnce upon a time"  # routed by prefix as a chat would be
    counted = httpx.post(f"{gateway.url}/v1/responses/input_tokens", json={
        "model": MODEL, "instructions": "Be brief.", "input": response["input"]}, timeout=30)
    assert counted.json() == {"object": "response.input_tokens",
                              "input_tokens": direct.json()["usage"]["input_tokens"]}


def test_a_resumable_stream_is_forwarded_plain(gateway: Gateway, replicas: list[Process]) -> None:
    """The gateway does not route resumes (GET /v1/streams/{id}) to the replica holding a stream, so it
    asks for none: no stream id comes back, and the stream is the plain one."""
    body = _chat("Tell me a story.", max_tokens=6, stream=True, stream_options={"resumable": True})
    direct = httpx.post(f"{replicas[0].url}/v1/chat/completions", json=body, timeout=30)
    proxied = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=30)
    assert direct.status_code == proxied.status_code == 200
    assert "x-stream-id" in direct.headers and "x-stream-id" not in proxied.headers
    assert _events(proxied.text)[-1] == "[DONE]"


def test_errors_models_and_health(gateway: Gateway, replicas: list[Process]) -> None:
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json={**_chat("hi"), "model": "nope"})
    assert response.status_code == 404
    assert response.json() == {"error": {"message": "The model `nope` does not exist.",
                                         "type": "invalid_request_error", "param": "model",
                                         "code": "model_not_found"}}
    bad = httpx.post(f"{gateway.url}/v1/completions", content=b"{not json")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    deep = b'{"model": "tiny", "prompt": "x", "user": ' + b'{"a": ' * 3000 + b'"x"' + b"}" * 3001
    bad = httpx.post(f"{gateway.url}/v1/completions", content=deep)  # past the JSON parser's depth: was a 500
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    # The replica's own 400 comes back as it is.
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json={**_chat("hi"), "max_tokens": -1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
    assert [m["id"] for m in httpx.get(f"{gateway.url}/v1/models").json()["data"]] == [MODEL]
    assert httpx.get(f"{gateway.url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{gateway.url}/metrics").text
    assert _metric(text, "llmserve:gateway_replica_healthy", pool=MODEL) == 3


def test_the_proxied_paths_keep_the_body_bound_and_their_errors(gateway: Gateway) -> None:
    """The proxied POSTs skip FastAPI (gateway/lane.py): what its stack did for them still holds."""
    url = f"{gateway.url}/v1/chat/completions"
    over = DEFAULT_MAX_REQUEST_BODY_BYTES + 1
    declared = httpx.post(url, content=b" " * over, headers={"content-type": "application/json"}, timeout=30)
    chunked = httpx.post(url, content=iter([b" " * (over // 2), b" " * (over // 2 + 1)]), timeout=30)
    for response in (declared, chunked):
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    not_an_object = httpx.post(url, json=["model"])
    assert not_an_object.status_code == 400 and not_an_object.json()["error"]["code"] == "missing_model"
    assert httpx.get(url).status_code == 405
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3,
                                                                       "stream": True}, timeout=30) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
        assert _events(stream.read().decode())[-1] == "[DONE]"


def test_cli_gateway_with_pools_from_flags_and_config(replicas: list[Process], tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(f"pools:\n  {MODEL}:\n    - {replicas[0].url}\n")
    command = [sys.executable, "-m", "llmserve.cli", "gateway", "--config", str(config),
               "--pool", f"other={replicas[1].url},{replicas[2].url}", "--policy", "round_robin", "--port", "0"]
    proc, ready, found = _start(command, r"llmserve: gateway at (http://\S+)/v1")
    try:
        assert ready.wait(30), "the gateway did not start"
        url = found[0]
        assert sorted(m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]) == ["other", MODEL]
        response = httpx.post(f"{url}/v1/chat/completions", json=_chat("hello"), timeout=30)
        assert response.status_code == 200 and response.json()["model"] == MODEL
    finally:
        _stop(proc)
    assert proc.returncode == 0


async def _load(gateway_url: str, victim_in_flight: Callable[[], int], kill: Callable[[], None]) -> tuple:
    async with httpx.AsyncClient(base_url=gateway_url, timeout=60) as client:
        plain = [asyncio.create_task(client.post("/v1/chat/completions", json=_chat(
            f"request {i}: " + "tell me more " * 20, max_tokens=32, ignore_eos=True))) for i in range(30)]

        async def stream(i: int) -> str:
            body = _chat(f"stream {i}: " + "go on " * 20, max_tokens=64, ignore_eos=True, stream=True)
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                return (await response.aread()).decode()

        streams = [asyncio.create_task(stream(i)) for i in range(6)]
        deadline = time.monotonic() + 30
        while victim_in_flight() < 4:
            assert time.monotonic() < deadline, "the victim never had requests in flight"
            await asyncio.sleep(0.01)
        kill()
        results = await asyncio.wait_for(asyncio.gather(*plain, *streams), timeout=90)
        return results[:len(plain)], results[len(plain):]


def test_kill_9_of_a_replica_under_load(gateway: Gateway, replicas: list[Process]) -> None:
    victim_process = replicas[2]
    victim = next(r for r in gateway.pool.replicas if r.url == victim_process.url)
    killed_at: list[float] = []
    ejected_at: list[float] = []

    def kill() -> None:
        os.kill(victim_process.proc.pid, signal.SIGKILL)
        killed_at.append(time.monotonic())

        def watch() -> None:
            _wait_until(lambda: victim.state is ReplicaState.EJECTED, 10, "the ejection")
            ejected_at.append(time.monotonic())

        threading.Thread(target=watch, daemon=True).start()

    before = httpx.get(f"{gateway.url}/metrics").text
    plain, streams = asyncio.run(_load(gateway.url, lambda: victim.in_flight, kill))

    _wait_until(lambda: bool(ejected_at), 10, "the victim's ejection")
    assert ejected_at[0] - killed_at[0] <= 2.0
    for response in plain:
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] == "length"
    broken = 0
    for text in streams:
        events = _events(text)
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        if "error" in last:
            broken += 1
            assert last["error"]["code"] == "replica_failed" and last["error"]["type"] == "server_error"
        else:
            assert last["choices"][0]["finish_reason"] == "length" or "usage" in last
    after = httpx.get(f"{gateway.url}/metrics").text
    retried = (_metric(after, "llmserve:gateway_requests_retried_total")
               - _metric(before, "llmserve:gateway_requests_retried_total"))
    streams_broken = (_metric(after, "llmserve:gateway_streams_broken_total")
                      - _metric(before, "llmserve:gateway_streams_broken_total"))
    assert streams_broken == broken
    assert retried + broken >= 1, "the victim had requests in flight, so something was retried or broken"
    assert _metric(after, "llmserve:gateway_replica_healthy", replica=victim.url) == 0
    # Afterwards the pool keeps serving on the two replicas left, and the gateway holds nothing in flight.
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat("still there?"), timeout=30)
    assert response.status_code == 200
    _wait_until(lambda: all(r.in_flight == 0 for r in gateway.pool.replicas), 5, "no request in flight")
