"""The engine core as a process of its own, under `llmserve serve` run as a real process: when the
core dies (`kill -9`, or a step that raises) every stream in flight ends within seconds with an error
event, /health answers 503 and then 200 once a new core serves, the next request succeeds, and no
process is left behind; when the API server dies, the core exits too."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests import faulty_model
from tests.server.test_serve_cli import _Lines

REPO = Path(__file__).resolve().parents[2]
NUM_STREAMS = 50
END_WITHIN_S = 5.0


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    model: str

    def forkserver_pid(self) -> int:
        """The server's child that engine cores fork from (the other is multiprocessing's resource tracker)."""
        pids = [pid for pid in _children(self.proc.pid) if "forkserver" in _cmdline(pid)]
        assert len(pids) == 1, f"expected one forkserver, found {pids}"
        return pids[0]

    def core_pid(self) -> int:
        """The engine core: the forkserver's one live child."""
        pids = _children(self.forkserver_pid())
        assert len(pids) == 1, f"expected one engine core process, found {pids}"
        return pids[0]


def _children(parent: int) -> list[int]:
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _alive(int(entry.name)):
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                children.append(int(entry.name))
    return children


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped by someone else has ended: it holds nothing)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_until(condition, timeout: float, what: str) -> None:
    """Poll a condition another process will make true (a process exiting or starting)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator:
    procs: list[subprocess.Popen] = []

    def start(model_dir: Path, plugins: str | None = None) -> Server:
        command = [sys.executable, "-m", "llmserve.cli", "serve", "--model", str(model_dir), "--port", "0",
                   "--dtype", "float32", "--num-kv-blocks", "2048", "--max-model-len", "512", "--no-platform"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
        if plugins:
            env["LLMSERVE_PLUGINS"] = plugins
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        procs.append(proc)
        match = _Lines(proc).wait_for(r"serving (\S+) at (http://\S+)/v1")
        return Server(proc, match.group(2), match.group(1))

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def _stream(http: httpx.AsyncClient, body: dict, started: asyncio.Event, counter: list[int]) -> tuple:
    """One streamed completion: (its last data event, the time it ended)."""
    events: list[str] = []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if not events:
                counter[0] += 1
                if counter[0] == NUM_STREAMS:
                    started.set()
            events.append(line[len("data: "):])
    return events, time.monotonic()


def _run_streams_then(server: Server, fault) -> tuple[list[tuple], float]:
    """50 concurrent streams; once each has a token, `fault()`; returns each stream's events and end time,
    and when the fault struck."""
    body = {"model": server.model, "prompt": [5, 6, 7, 8], "max_tokens": 480, "ignore_eos": True, "stream": True}

    async def main():
        started, counter = asyncio.Event(), [0]
        limits = httpx.Limits(max_connections=NUM_STREAMS + 5)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as http:
            tasks = [asyncio.ensure_future(_stream(http, body, started, counter)) for _ in range(NUM_STREAMS)]
            await asyncio.wait_for(started.wait(), 60)
            struck = time.monotonic()
            await fault(http)
            return await asyncio.gather(*tasks), struck

    return asyncio.run(main())


def _assert_failed_fast_then_recovered(server: Server, results: list[tuple], struck: float, reason: str) -> None:
    for events, ended in results:
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_dead" and reason in error["message"]
        assert ended - struck < END_WITHIN_S
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        _wait_until(lambda: http.get("/health").status_code == 200, 120, "the new engine core")
        served = http.post("/v1/completions", json={"model": server.model, "prompt": "Hello", "max_tokens": 5})
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 5
        metrics = http.get("/metrics").text
        assert f'llmserve:engine_core_restarts_total{{model_name="{server.model}"}} 1.0' in metrics


def _assert_nothing_left_after_sigterm(server: Server, pids: list[int]) -> None:
    """SIGTERM: the server exits 0, and neither the cores named nor any other child outlives it."""
    pids = [*pids, *_children(server.proc.pid)]
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0
    for pid in pids:  # the cores are reaped before the exit; multiprocessing's tracker follows at once
        _wait_until(lambda pid=pid: not _alive(pid), 10, f"process {pid} ({_cmdline(pid)}) to end")


def test_kill_9_of_the_engine_core_fails_streams_fast_and_a_new_core_serves(start_server, tiny_llama_dir):
    server = start_server(tiny_llama_dir)
    first_core = server.core_pid()

    async def kill_core(http: httpx.AsyncClient) -> None:
        os.kill(first_core, signal.SIGKILL)

    results, struck = _run_streams_then(server, kill_core)
    _assert_failed_fast_then_recovered(server, results, struck, "exited unexpectedly")
    second_core = server.core_pid()
    assert second_core != first_core and not _alive(first_core)
    _assert_nothing_left_after_sigterm(server, [first_core, second_core])


def test_a_step_that_raises_fails_streams_fast_and_a_new_core_serves(start_server, tiny_llama_dir, tmp_path):
    server = start_server(faulty_model.faulty_copy(tiny_llama_dir, tmp_path / "faulty"), plugins="tests.faulty_model")
    first_core = server.core_pid()

    async def poison(http: httpx.AsyncClient) -> None:
        body = {"model": server.model, "prompt": [5, faulty_model.FAULT_TOKEN], "max_tokens": 4}
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"

    results, struck = _run_streams_then(server, poison)
    _assert_failed_fast_then_recovered(server, results, struck, "injected fault")
    second_core = server.core_pid()
    assert second_core != first_core
    _wait_until(lambda: not _alive(first_core), 10, "the failed core to exit")
    _assert_nothing_left_after_sigterm(server, [first_core, second_core])


def test_the_engine_core_exits_when_the_api_server_dies(start_server, tiny_llama_dir):
    server = start_server(tiny_llama_dir)
    forkserver, core = server.forkserver_pid(), server.core_pid()
    server.proc.kill()
    server.proc.wait()
    _wait_until(lambda: not _alive(core), 10, "the orphaned engine core to exit")
    _wait_until(lambda: not _alive(forkserver), 10, "the forkserver to exit")
