"""`llmserve serve` as a real process: it prints its URL, serves, and on SIGTERM refuses new requests,
lets the in-flight stream finish, and exits 0."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest

STARTUP_TIMEOUT = 120


class _Lines:
    """The process's output, line by line, read on a thread so waiting for a line can time out."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float = STARTUP_TIMEOUT) -> re.Match:
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                pytest.fail(f"no line matching {pattern!r}; output so far:\n{''.join(self.seen)}")
            self.seen.append(line)
            match = re.search(pattern, line)
            if match:
                return match


@pytest.fixture
def server_process(tiny_llama_dir):
    command = [
        sys.executable,
        "-m",
        "llmserve.cli",
        "serve",
        "--model",
        str(tiny_llama_dir),
        "--port",
        "0",
        "--dtype",
        "float32",
        "--num-kv-blocks",
        "128",
        "--max-model-len",
        "512",
        "--shutdown-timeout",
        "60",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        yield proc, _Lines(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_finishes_in_flight_refuses_new_and_exits_0(server_process, tiny_llama_dir):
    proc, output = server_process
    match = output.wait_for(r"serving (\S+) at (http://\S+)/v1")
    name, base_url = match.group(1), match.group(2)
    assert name == tiny_llama_dir.name
    body = {
        "model": name,
        "prompt": "Once upon a time",
        "max_tokens": 480,
        "n": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    finish_reasons: dict[int, str] = {}
    with httpx.Client(base_url=base_url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(lines) == "id: 0" and next(lines).startswith("data: {")  # the request is running
            proc.send_signal(signal.SIGTERM)
            output.wait_for("shutting down", timeout=30)
            try:
                refused = httpx.post(f"{base_url}/v1/completions", json={**body, "stream": False}, timeout=30)
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "shutting_down"
            except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                pass  # the socket is closed already, or closes the new connection unanswered: refused too
            done = False
            for line in lines:
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    for choice in json.loads(line[6:])["choices"]:
                        if choice["finish_reason"]:
                            finish_reasons[choice["index"]] = choice["finish_reason"]
    assert done and finish_reasons == {i: "length" for i in range(4)}
    assert proc.wait(timeout=60) == 0


def test_model_arguments_name_models_and_keep_the_typed_path_as_an_alias(tmp_path):
    import argparse

    from llmserve.server.serve import _aliases, parse_model_args

    (tmp_path / "second").mkdir()
    models = parse_model_args(["first=/models/one", str(tmp_path / "second")], None)
    assert [(m.name, m.model, m.aliases) for m in models] == [
        ("first", "/models/one", []),
        ("second", str(tmp_path / "second"), [str(tmp_path / "second")]),
    ]
    args = argparse.Namespace(alias=["chat=first:3,second:1"])
    assert _aliases(args, None, models) == {
        str(tmp_path / "second"): [("second", 1.0)],
        "chat": [("first", 0.75), ("second", 0.25)],
    }
    assert [m.name for m in parse_model_args(None, None)] == ["llmserve-default"]
    assert [m.name for m in parse_model_args(["hub/model-id"], "custom")] == ["custom"]
    with pytest.raises(ValueError, match="same name"):
        parse_model_args(["a=/x", "a=/y"], None)
    with pytest.raises(ValueError, match="names one model"):
        parse_model_args(["/x", "/y"], "custom")
    with pytest.raises(ValueError, match="checkpoint directory or hub id"):
        parse_model_args(["a="], None)
