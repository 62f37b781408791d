"""The Batch API against the same requests sent by a client, and what a running batch costs interactive requests,
on `llmserve serve` (its own process, the platform on, SQLite) over the built-in `--size` Llama (random weights).

Arms, alternated round by round (which of `batch` and `client` goes first too), each with prompts of its own:
- `batch`: `--requests` chat completions (`--max-tokens` each, ignore_eos) uploaded as a file and run as a batch
  (`--batch-concurrency` at once); timed from `POST /v1/batches` until it reads `completed` (polled every 0.5 s,
  every 20 ms once the last `--batch-concurrency` requests run);
- `client`: the same requests sent by a client over HTTP, `--batch-concurrency` at a time; timed whole;
- `interactive, idle` and `interactive, batch running`: `--probes` streamed chat completions (16 tokens) one after
  another (each a new prompt: no prefix cache hit), their time to first token, with nothing else running and
  while a batch of the same size runs.

    python benchmarks/batch_api.py [--size small] [--rounds 3] [--requests 64] [--max-tokens 32] [--batch-concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmserve.model.builtin import make_model  # noqa: E402

MODEL = "bench"


@contextmanager
def server(model_dir: Path, data_dir: Path, concurrency: int) -> Iterator[str]:
    command = [sys.executable, "-m", "llmserve.cli", "serve", "--model", str(model_dir), "--served-model-name", MODEL,
               "--port", "0", "--batch-concurrency", str(concurrency), "--database-url",
               f"sqlite:///{data_dir / 'bench.db'}"]
    env = {**os.environ, "LLMSERVE_DATA_DIR": str(data_dir), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        for line in proc.stdout:
            found = re.search(r"serving \S+ at (http://\S+)/v1", line)
            if found:
                yield found.group(1)
                break
        else:
            raise RuntimeError("the server did not start")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def bodies(count: int, max_tokens: int) -> list[dict]:
    """Requests no earlier run has sent (the prefix cache helps no arm more than another)."""
    nonce = random.random()
    return [{"model": MODEL, "messages": [{"role": "user", "content": f"Request {nonce} {i}: tell me a story."}],
             "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0} for i in range(count)]


def run_batch(http: httpx.Client, requests: list[dict], concurrency: int) -> float:
    lines = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n" for i, body in enumerate(requests))
    uploaded = http.post("/v1/files", files={"file": ("in.jsonl", lines.encode())}, data={"purpose": "batch"}).json()
    started = time.perf_counter()
    batch = http.post("/v1/batches", json={"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions",
                                           "completion_window": "24h"}).json()
    while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
        counts = batch["request_counts"]
        # Polled rarely while requests run (a poll takes the API process's time from them), often once the last
        # `concurrency` requests run (they end together: they are all as long).
        last_wave = counts["total"] and counts["completed"] + counts["failed"] >= counts["total"] - concurrency
        time.sleep(0.02 if last_wave else 0.5)
        batch = http.get(f"/v1/batches/{batch['id']}").json()
    elapsed = time.perf_counter() - started
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == len(requests), batch
    return elapsed


async def run_client(base_url: str, requests: list[dict], concurrency: int) -> float:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        async def one(body: dict) -> None:
            async with gate:
                response = await http.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text

        started = time.perf_counter()
        await asyncio.gather(*(one(body) for body in requests))
        return time.perf_counter() - started


def _has_text(chunk: dict) -> bool:
    """A chunk with generated text (the first one carries the role and no text)."""
    return any((choice.get("delta") or {}).get("content") for choice in chunk.get("choices", ()))


def ttfts(http: httpx.Client, probes: int) -> list[float]:
    found = []
    for _ in range(probes):
        question = f"Quick question {random.random()}: what is the capital of France, and why is it there?"
        body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 16, "stream": True}
        started = time.perf_counter()
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {") and _has_text(json.loads(line[len("data: "):])):
                    found.append(time.perf_counter() - started)
                    break
            for _ in lines:  # the rest of the answer
                pass
    return found


def ttfts_while_a_batch_runs(http: httpx.Client, base_url: str, requests: list[dict], probes: int,
                             concurrency: int) -> list[float]:
    done: list[float] = []
    with httpx.Client(base_url=base_url, timeout=600) as batch_http:
        runner = threading.Thread(target=lambda: done.append(run_batch(batch_http, requests, concurrency)))
        runner.start()
        time.sleep(0.5)  # the batch's requests are running
        found = ttfts(http, probes)
        runner.join()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-concurrency", type=int, default=8)
    parser.add_argument("--probes", type=int, default=8)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"batch": [], "client": []}
    probes: dict[str, list[float]] = {"idle": [], "batch running": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model", arch="llama", size=args.size)
        with server(model, Path(tmp), args.batch_concurrency) as base_url, \
                httpx.Client(base_url=base_url, timeout=600) as http:
            run_batch(http, bodies(8, args.max_tokens), args.batch_concurrency)  # warm-up
            for round_ in range(args.rounds):
                arms = [
                    ("batch", lambda: run_batch(http, bodies(args.requests, args.max_tokens), args.batch_concurrency)),
                    ("client", lambda: asyncio.run(run_client(base_url, bodies(args.requests, args.max_tokens),
                                                              args.batch_concurrency))),
                ]
                for name, arm in arms if round_ % 2 == 0 else reversed(arms):
                    times[name].append(arm())
                probes["idle"].extend(ttfts(http, args.probes))
                probes["batch running"].extend(ttfts_while_a_batch_runs(
                    http, base_url, bodies(args.requests, args.max_tokens), args.probes, args.batch_concurrency))
    tokens = args.requests * args.max_tokens
    print(f"{args.size} Llama, {args.requests} requests x {args.max_tokens} tokens, concurrency "
          f"{args.batch_concurrency}, {args.rounds} rounds alternated")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"{name:7s} {median:6.2f} s  {tokens / median:7.1f} output tok/s  (rounds: "
              f"{', '.join(f'{s:.2f}' for s in seconds)})")
    ratios = [b / c for b, c in zip(times["batch"], times["client"], strict=True)]
    print(f"batch / client time: median {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
    for name, found in probes.items():
        ms = sorted(t * 1000 for t in found)
        print(f"interactive TTFT, {name}: p50 {statistics.median(ms):.0f} ms, p90 {ms[int(0.9 * (len(ms) - 1))]:.0f} ms"
              f" ({len(ms)} requests)")


if __name__ == "__main__":
    main()
