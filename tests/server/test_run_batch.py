"""`llmserve run-batch` run as a user runs it: every request of the file answered as the server answers the same
request, failures included, in input order; a file that is no batch refused whole, naming its lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from tests.server.conftest import MODEL_NAME, LiveServer

REPO = Path(__file__).resolve().parents[2]


def _run_batch(model_dir: Path, lines: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(line + "\n" for line in lines))
    command = [sys.executable, "-m", "llmserve.cli", "run-batch", "--model", str(model_dir), "--served-model-name",
               MODEL_NAME, "--dtype", "float32", "--max-model-len", "512", "-i", str(source), "-o", str(output)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _without_cache(usage: dict) -> dict:
    return {key: value for key, value in usage.items() if key != "prompt_tokens_details"}


def test_each_request_is_answered_as_the_server_answers_it(live_server: LiveServer, tiny_llama_dir, tmp_path):
    requests = {
        "chat": ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}],
                                          "max_tokens": 6, "temperature": 0}),
        "text": ("/v1/completions", {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": 5,
                                     "temperature": 0}),
        "unknown-model": ("/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 2}),
    }
    ran = _run_batch(tiny_llama_dir, [_line(name, url, body) for name, (url, body) in requests.items()], tmp_path)
    assert ran.returncode == 0, ran.stderr
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [record["custom_id"] for record in records] == list(requests)
    with httpx.Client(base_url=live_server.base_url, timeout=60) as http:
        for record in records:
            url, body = requests[record["custom_id"]]
            served = http.post(url, json=body)
            assert record["response"]["status_code"] == served.status_code
            answer = record["response"]["body"]
            if served.status_code == 200:
                assert answer["choices"][0].get("message", answer["choices"][0].get("text")) == \
                    served.json()["choices"][0].get("message", served.json()["choices"][0].get("text"))
                # Cached tokens depend on what the prefix cache holds: the batch's own earlier requests share
                # its BOS block, and the live server's cache holds whatever earlier tests left.
                assert _without_cache(answer["usage"]) == _without_cache(served.json()["usage"])
            else:
                assert answer["error"]["code"] == served.json()["error"]["code"]
    assert "3 requests, 1 failed" in ran.stderr


def test_a_file_that_is_no_batch_is_refused_naming_its_lines(tiny_llama_dir, tmp_path):
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
    ran = _run_batch(tiny_llama_dir, [_line("a", "/v1/completions", body), "{oops", _line("a", "/v1/completions", body),
                                      _line("b", "/v1/audio/speech", body)], tmp_path)
    assert ran.returncode == 2 and not (tmp_path / "out.jsonl").exists()
    assert [line.split(":")[1] for line in ran.stderr.splitlines()] == ["2", "3", "4"]
