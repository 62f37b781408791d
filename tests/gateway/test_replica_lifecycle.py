"""Replicas coming and going behind the gateway, with real `llmserve serve --no-platform` processes of the
tiny model: a `dns+` pool entry expanded into one replica per address (a resolver the test controls
points a name at loopback addresses, real sockets behind each), a hung replica (SIGSTOP) that holds no
client, and a rolling restart of every replica under continuous load with no failed request (each
old replica gets SIGTERM while requests run on it: the gateway sees it draining, sends it nothing new,
and its in-flight requests finish)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import uvicorn

from llmserve.gateway.app import ReplicaOptions, build_gateway_app
from llmserve.gateway.replica import Replica, ReplicaState
from tests.gateway.test_gateway import STARTUP_TIMEOUT_S, _events, _metric, _start, _stop, _wait_until

MODEL = "tiny"
NAME = "replicas.llmserve.test"
FIRST = 2  # replicas the pool starts with; as many spares replace them in the rolling restart


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Replicas:
    """Replicas on one port at 127.0.0.1, 127.0.0.2, ... (the addresses of one DNS name)."""

    port: int
    procs: dict[str, object] = field(default_factory=dict)  # address -> Popen

    def url(self, address: str) -> str:
        return f"http://{address}:{self.port}"


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir: Path) -> Iterator[Replicas]:
    port = _free_port()
    group = Replicas(port)
    started = {}
    for n in range(1, 2 * FIRST + 1):
        address = f"127.0.0.{n}"
        command = [
            sys.executable, "-m", "llmserve.cli", "serve", "--model", str(tiny_llama_dir), "--served-model-name",
            MODEL, "--no-platform", "--host", address, "--port", str(port), "--num-kv-blocks", "256",
            "--max-model-len", "512", "--shutdown-timeout", "30",
        ]
        started[address] = _start(command, r"serving \S+ at (http://\S+)/v1")
    try:
        for address, (proc, ready, _) in started.items():
            assert ready.wait(STARTUP_TIMEOUT_S), f"the replica at {address} did not start"
            assert proc.poll() is None
            group.procs[address] = proc
        yield group
    finally:
        for proc, _, _ in started.values():
            _stop(proc)


class Gateway:
    """The gateway app in process, on a free port, over one pool."""

    def __init__(self, urls: list[str], policy: str, options: ReplicaOptions) -> None:
        self.app = build_gateway_app({MODEL: urls}, policy, options)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Gateway:
        self.thread.start()
        _wait_until(lambda: self.server.started, 30, "the gateway to listen")
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    @property
    def pool(self):
        return self.app.state.gateway.pools[MODEL]

    def replica(self, url: str) -> Replica | None:
        return next((r for r in self.pool.replicas if r.url == url), None)

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics").text


def _chat(content: str, **extra: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
            "temperature": 0, **extra}


def _first_data(lines: Iterator[str]) -> str:
    """A stream's first data line (its events are numbered: `id: N` lines come before them)."""
    return next(line for line in lines if line.startswith("data: "))


def _completed(text: str) -> bool:
    """A stream that ended normally: [DONE] after a last choice with a finish reason, no error event."""
    events = _events(text)
    if events[-1:] != ["[DONE]"]:
        return False
    chunks = [json.loads(event) for event in events[:-1]]
    return not any("error" in chunk for chunk in chunks) and any(
        choice.get("finish_reason") == "length" for chunk in chunks for choice in chunk["choices"])


def test_a_dns_entry_is_one_replica_per_address_kept_current(replicas: Replicas) -> None:
    addresses = ["127.0.0.1", "127.0.0.2"]
    looked_up: list[str] = []

    async def resolver(host: str) -> list[str]:
        looked_up.append(host)
        if host != NAME:
            raise OSError(f"no such name {host}")
        return list(addresses)

    options = ReplicaOptions(resolver=resolver, resolve_interval_s=0.1)
    with Gateway([f"dns+http://{NAME}:{replicas.port}"], "round_robin", options) as gateway:
        urls = {replicas.url(a) for a in addresses}
        assert {r.url for r in gateway.pool.replicas} == urls  # resolved before the first request
        assert all(r.state is ReplicaState.HEALTHY for r in gateway.pool.replicas)
        served = set()
        for n in range(4):
            response = httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat(f"hello {n}"), timeout=30)
            assert response.status_code == 200, response.text
        text = gateway.metrics()
        served = {url for url in urls if _metric(text, "llmserve:gateway_requests_total", replica=url) == 2}
        assert served == urls  # round robin over both addresses

        addresses[:] = ["127.0.0.2", "127.0.0.3"]  # one address gone, one new
        want = {replicas.url("127.0.0.2"), replicas.url("127.0.0.3")}
        _wait_until(lambda: {r.url for r in gateway.pool.replicas} == want, 5, "the pool to follow the name")
        _wait_until(lambda: all(r.state is ReplicaState.HEALTHY for r in gateway.pool.replicas), 5,
                    "the new address to be health-checked")
        for n in range(2):
            response = httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat(f"again {n}"), timeout=30)
            assert response.status_code == 200
        text = gateway.metrics()
        assert _metric(text, "llmserve:gateway_requests_total", replica=replicas.url("127.0.0.3")) == 1
        assert _metric(text, "llmserve:gateway_requests_total", replica=replicas.url("127.0.0.1")) == 2

        def failing(host: str) -> list[str]:
            raise OSError("the DNS server is down")

        async def broken(host: str) -> list[str]:
            return failing(host)

        gateway.app.state.gateway.discovery.resolver = broken  # a failed lookup keeps what is known
        lookups = len(looked_up)
        time.sleep(0.3)  # three resolve intervals with the lookup failing
        assert {r.url for r in gateway.pool.replicas} == want and len(looked_up) == lookups


def test_a_hung_replica_holds_no_client(replicas: Replicas) -> None:
    """SIGSTOP: the replica's socket still accepts connections, nothing answers. A request waiting on it
    moves to another replica once the health checks eject it; a stream it stalls ends with an error
    event; SIGCONT brings it back."""
    urls = [replicas.url(f"127.0.0.{n}") for n in (1, 2, 3)]
    hung_address = "127.0.0.1"
    hung_proc = replicas.procs[hung_address]
    options = ReplicaOptions(health_timeout_s=0.3, stream_idle_timeout_s=1.5)
    with Gateway(urls, "round_robin", options) as gateway:
        hung = gateway.replica(urls[0])
        body = _chat("a long story", max_tokens=400, ignore_eos=True, stream=True)
        with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=30) as stream:
            lines = stream.iter_lines()
            assert _first_data(lines).startswith("data: {")  # round robin: the first request is the hung one's
            assert hung.in_flight == 1
            hung_proc.send_signal(signal.SIGSTOP)
            try:
                stopped_at = time.monotonic()
                rest = "\n".join(lines)
                stalled_for = time.monotonic() - stopped_at
                events = _events(rest)
                assert events[-1] == "[DONE]"
                error = json.loads(events[-2])["error"]
                assert error["code"] == "replica_failed" and "sent nothing for 1.5 s" in error["message"]
                assert stalled_for < 5
                _wait_until(lambda: hung.state is ReplicaState.EJECTED, 5, "the hung replica's ejection")
                assert time.monotonic() - stopped_at < 3  # two health timeouts of 0.3 s, polled every 0.5 s

                async def requests() -> list[httpx.Response]:
                    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
                        return await asyncio.gather(*(
                            client.post("/v1/chat/completions", json=_chat(f"question {n}")) for n in range(6)))

                started = time.monotonic()
                responses = asyncio.run(requests())
                assert [r.status_code for r in responses] == [200] * 6
                assert time.monotonic() - started < 10
                assert _metric(gateway.metrics(), "llmserve:gateway_requests_total", replica=urls[0]) == 1
            finally:
                hung_proc.send_signal(signal.SIGCONT)
        _wait_until(lambda: hung.state is ReplicaState.HEALTHY, 10, "the replica's return after SIGCONT")


def test_a_request_waiting_on_a_replica_that_hangs_is_retried_elsewhere(replicas: Replicas) -> None:
    urls = [replicas.url(f"127.0.0.{n}") for n in (1, 2)]
    hung_proc = replicas.procs["127.0.0.1"]
    options = ReplicaOptions(health_timeout_s=0.3)
    with Gateway(urls, "round_robin", options) as gateway:
        hung = gateway.replica(urls[0])
        hung_proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            # Round robin sends this one to the stopped replica, whose health checks have not failed yet;
            # its ejection ends the wait (the first-byte timeout is 600 s) and the retry answers.
            response = httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat("anyone?"), timeout=30)
            assert response.status_code == 200, response.text
            assert time.monotonic() - started < 5
            assert hung.state is ReplicaState.EJECTED
            text = gateway.metrics()
            assert _metric(text, "llmserve:gateway_requests_retried_total") == 1
            assert _metric(text, "llmserve:gateway_requests_total", replica=urls[0]) == 1
        finally:
            hung_proc.send_signal(signal.SIGCONT)
        _wait_until(lambda: hung.state is ReplicaState.HEALTHY, 10, "the replica's return after SIGCONT")


@dataclass
class Load:
    """Clients sending requests (every other one streamed) through the gateway until stopped."""

    url: str
    results: list[tuple[bool, str]] = field(default_factory=list)  # (ok, what went wrong)
    stop: threading.Event = field(default_factory=threading.Event)

    async def _client(self, n: int) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=60) as client:
            i = 0
            while not self.stop.is_set():
                i += 1
                body = _chat(f"client {n} request {i}: " + "go on " * 10, max_tokens=24, ignore_eos=True)
                if i % 2:
                    async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                        text = (await r.aread()).decode()
                    ok = r.status_code == 200 and _completed(text)
                else:
                    r = await client.post("/v1/chat/completions", json=body)
                    ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
                    text = r.text
                self.results.append((ok, "" if ok else f"{r.status_code}: {text[-300:]}"))

    def run(self, clients: int) -> threading.Thread:
        async def main() -> None:
            await asyncio.gather(*(self._client(n) for n in range(clients)))

        thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
        thread.start()
        return thread


def test_rolling_restart_of_every_replica_under_load_fails_no_request(replicas: Replicas) -> None:
    """Kubernetes' rollout, replica by replica: the new pod's address joins the name, it turns healthy,
    the old pod gets SIGTERM (while requests run on it), drains and exits 0, and its address leaves."""
    addresses = [f"127.0.0.{n}" for n in range(1, FIRST + 1)]
    spares = [f"127.0.0.{n}" for n in range(FIRST + 1, 2 * FIRST + 1)]

    async def resolver(host: str) -> list[str]:
        return list(addresses)

    # A slow /health on these two shared cores must not pass for a failure: ejections are counted below.
    options = ReplicaOptions(resolver=resolver, resolve_interval_s=0.1, health_timeout_s=2.0)
    with Gateway([f"dns+http://{NAME}:{replicas.port}"], "prefix", options) as gateway:
        load = Load(gateway.url)
        thread = load.run(clients=6)
        seen_draining: set[str] = set()
        try:
            for old, new in zip(list(addresses), spares, strict=True):
                addresses.append(new)
                _wait_until(lambda new=new: (r := gateway.replica(replicas.url(new))) is not None
                            and r.state is ReplicaState.HEALTHY, 10, f"{new} to join")
                victim = gateway.replica(replicas.url(old))
                assert victim is not None
                proc = replicas.procs[old]
                # A long stream straight to the old replica: it is still running when SIGTERM comes.
                body = _chat("a long story", max_tokens=450, ignore_eos=True, stream=True)
                with httpx.stream("POST", f"{replicas.url(old)}/v1/chat/completions", json=body,
                                  timeout=60) as direct:
                    lines = direct.iter_lines()
                    assert _first_data(lines).startswith("data: {")
                    proc.send_signal(signal.SIGTERM)
                    _wait_until(lambda victim=victim: victim.state is not ReplicaState.HEALTHY, 5,
                                f"{old} to leave the routing")
                    if victim.state is ReplicaState.DRAINING:
                        seen_draining.add(old)
                    assert _completed("\n".join(lines))  # in flight at SIGTERM: it finishes
                assert proc.wait(timeout=60) == 0
                addresses.remove(old)
                _wait_until(lambda old=old: gateway.replica(replicas.url(old)) is None, 5, f"{old} to leave")
                done = len(load.results)
                _wait_until(lambda done=done: len(load.results) >= done + 6, 30, "requests after the swap")
        finally:
            load.stop.set()
            thread.join(timeout=60)
        failures = [why for ok, why in load.results if not ok]
        assert not failures, failures
        assert len(load.results) >= 30, len(load.results)
        assert seen_draining == {f"127.0.0.{n}" for n in range(1, FIRST + 1)}  # each old replica drained
        text = gateway.metrics()
        assert _metric(text, "llmserve:gateway_replica_ejections_total") == 0  # draining is not failing
        assert {r.url for r in gateway.pool.replicas} == {replicas.url(a) for a in spares}
        _wait_until(lambda: all(r.in_flight == 0 for r in gateway.pool.replicas), 5, "no request in flight")
