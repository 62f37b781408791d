"""The platform's own cost: the same server with API-key auth, rate limiting and usage metering on,
against it with them off (`--no-platform`), measured in one run on the same model.

Both servers run at once (an idle one costs nothing) and are driven alternately, so drift in the
machine's speed falls on both alike:
- latency: one request at a time, A and B interleaved; the added latency is the difference of the
  two latency distributions' percentiles;
- saturation: `--concurrency` clients for `--saturation-requests` requests, rounds alternating
  between the servers; requests/s per round, the median round compared.

Requests are short (`--max-tokens`, default 4) so the server's per-request work weighs as much as it
can against the model's: the worst case for the platform's share.

The platform runs once per `--journal-sync` mode (`fsync,write`: a server each, each with its own
database), so the usage journal's durability modes are compared in the same run too.

    python benchmarks/platform_overhead.py [--model DIR] [--journal-sync fsync,write] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx


@contextmanager
def server(model: str, *extra: str) -> Iterator[str]:
    command = [
        sys.executable, "-m", "llmserve.cli", "serve", "--model", model, "--port", "0",
        "--max-model-len", "512", "--num-kv-blocks", "1024", "--max-num-batched-tokens", "1024",
        "--max-waiting-requests", "100000", *extra,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            match = re.search(r"serving \S+ at (http://\S+)/v1", line)
            if match:
                url.append(match.group(1))
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not ready.wait(timeout=300):
            raise RuntimeError(f"server {' '.join(extra)} did not start")
        yield url[0]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def on_name(mode: str) -> str:
    return f"on/{mode}"


def body(i: int, max_tokens: int) -> dict:
    return {
        "model": None,
        "messages": [{"role": "user", "content": f"Question {i}: what is the weather like today?"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def measure_latency(urls: dict[str, str], headers: dict[str, dict], n: int, max_tokens: int) -> dict[str, list[float]]:
    latencies: dict[str, list[float]] = {name: [] for name in urls}
    clients = {name: httpx.Client(base_url=url, headers=headers[name], timeout=60) for name, url in urls.items()}
    try:
        for i in range(n + 20):
            order = list(urls) if i % 2 == 0 else list(reversed(urls))  # alternate who goes first
            for name in order:
                payload = {k: v for k, v in body(i, max_tokens).items() if v is not None}
                started = time.perf_counter()
                response = clients[name].post("/v1/chat/completions", json=payload)
                elapsed = time.perf_counter() - started
                response.raise_for_status()
                if i >= 20:  # the first requests warm connections and caches
                    latencies[name].append(elapsed * 1000)
    finally:
        for client in clients.values():
            client.close()
    return latencies


async def saturate(url: str, headers: dict, total: int, concurrency: int, max_tokens: int) -> float:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300, limits=limits) as client:
        next_index = iter(range(total))

        async def worker() -> None:
            for i in next_index:
                payload = {k: v for k, v in body(i, max_tokens).items() if v is not None}
                response = await client.post("/v1/chat/completions", json=payload)
                response.raise_for_status()

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return total / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny model)")
    parser.add_argument("--latency-requests", type=int, default=300)
    parser.add_argument("--saturation-requests", type=int, default=600)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--journal-sync", default="fsync", help="comma-separated usage journal sync modes")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    modes = args.journal_sync.split(",")

    from llmserve.model.builtin import make_model
    from llmserve.platform.keys import KeyStore
    from llmserve.store.db import open_database

    with tempfile.TemporaryDirectory() as tmp, ExitStack() as servers:
        model = args.model or str(make_model(Path(tmp) / "tiny", "llama", "tiny", 0))
        urls = {"off": servers.enter_context(server(model, "--no-platform"))}
        headers: dict[str, dict] = {"off": {}}
        for mode in modes:
            database_url = f"sqlite:///{Path(tmp) / f'platform-{mode}.db'}"
            database = open_database(database_url)
            _, secret = KeyStore(database).create("bench", rpm=10**9, tpm=10**12)
            database.dispose()
            name = on_name(mode)
            headers[name] = {"Authorization": f"Bearer {secret}"}
            urls[name] = servers.enter_context(
                server(model, "--database-url", database_url, "--usage-journal-sync", mode)
            )
        latencies = measure_latency(urls, headers, args.latency_requests, args.max_tokens)
        rates: dict[str, list[float]] = {name: [] for name in urls}
        for round_index in range(args.rounds):
            order = list(urls) if round_index % 2 == 0 else list(reversed(urls))
            for name in order:
                rate = asyncio.run(
                    saturate(urls[name], headers[name], args.saturation_requests, args.concurrency, args.max_tokens)
                )
                rates[name].append(rate)
    result = {
        "model": model if args.model else "built-in tiny llama",
        "workload": f"chat, {args.max_tokens} output tokens, ~15-token prompts",
        "latency_ms": {
            name: {"p50": percentile(values, 50), "p99": percentile(values, 99), "mean": statistics.fmean(values)}
            for name, values in latencies.items()
        },
        "requests_per_s": {name: statistics.median(values) for name, values in rates.items()},
        "rounds": rates,
    }
    off = result["latency_ms"]["off"]
    result["added_latency_ms"] = {
        name: {q: result["latency_ms"][name][q] - off[q] for q in ("p50", "p99", "mean")}
        for name in urls if name != "off"
    }
    result["throughput_loss_pct"] = {
        name: 100 * (1 - result["requests_per_s"][name] / result["requests_per_s"]["off"])
        for name in urls if name != "off"
    }
    print(json.dumps(result, indent=2))
    print()
    print("| | p50 ms | p99 ms | requests/s (median of rounds) | added p50 ms | added p99 ms | throughput |")
    print("|---|---|---|---|---|---|---|")
    for name in urls:
        lat = result["latency_ms"][name]
        label = "platform off" if name == "off" else f"auth + limits + metering, journal {name[3:]}"
        row = f"| {label} | {lat['p50']:.2f} | {lat['p99']:.2f} | {result['requests_per_s'][name]:.1f} |"
        if name != "off":
            added = result["added_latency_ms"][name]
            row += f" {added['p50']:+.2f} | {added['p99']:+.2f} | {-result['throughput_loss_pct'][name]:+.1f}% |"
        else:
            row += " | | |"
        print(row)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
