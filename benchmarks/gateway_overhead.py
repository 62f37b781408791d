"""The gateway's added latency: the same requests sent straight to a backend and through `llmserve
gateway` in front of it, alternated in one run.

The backend is a fake OpenAI server (a bare ASGI app under uvicorn, in its own process, answering every
chat completion with one fixed reply at once), so what is measured is the gateway's own work (parse
the body, route, proxy the request and the reply), not a model's time, and 2 CPU cores can hold
200 requests/s through client, gateway and backend. Requests arrive open-loop (Poisson, `--rate` per
second) for `--block-s` seconds at a time, alternating direct and via-gateway blocks for `--rounds`
rounds; latency is send-to-last-byte at the client (aiohttp, several times cheaper per request than
httpx, so the client's own queueing weighs less). The added latency is the gateway distribution's
percentile minus the direct one's. The gateway process's CPU time per request (from /proc) is reported
too: on a machine whose cores are busy with other work, queueing behind that work inflates latency, not
CPU time.

    python benchmarks/gateway_overhead.py [--rate 200] [--rounds 6] [--block-s 5] [--stream] [--no-platform] [--json out.json]
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
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp

MODEL = "fake"
REPLY = json.dumps({
    "id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
}).encode()
HEADERS = {"content-type": "application/json"}
CHUNK = json.dumps({
    "id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "length"}],
}).encode()


async def fake_backend(scope, receive, send) -> None:
    """The cheapest OpenAI-shaped answer: a fixed completion (or a two-event stream), and /health."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] in ("/health", "/metrics"):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b""})
        return
    if b'"stream": true' in body or b'"stream":true' in body:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: " + CHUNK + b"\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        return
    if any(name == b"x-llmserve-usage-progress" for name, _ in scope["headers"]):
        # as a replica answers the gateway's platform: the response as the one event (server/pipeline.py)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b"data: " + REPLY + b"\n\ndata: [DONE]\n\n"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": REPLY})


@contextmanager
def process(command: list[str], pattern: str) -> Iterator[tuple[str, int]]:
    """A process: the URL it prints (the first group of `pattern`) once it listens, and its pid."""
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
    try:
        if not ready.wait(60):
            raise RuntimeError(f"{command[:4]} did not start")
        yield found[0], proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def block(client: aiohttp.ClientSession, url: str, rate: float, seconds: float, stream: bool,
                rng: random.Random) -> list[float]:
    """Open-loop Poisson arrivals for `seconds`; each request's latency in ms."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "How are you today?"}], "max_tokens": 1,
            "stream": stream}
    payload = json.dumps(body).encode()
    latencies: list[float] = []

    async def one() -> None:
        started = time.perf_counter()
        async with client.post(url, data=payload, headers=HEADERS) as response:
            content = await response.read()
        if response.status != 200:
            raise RuntimeError(f"{url}: {response.status} {content[:200]!r}")
        latencies.append((time.perf_counter() - started) * 1000)

    tasks = []
    loop = asyncio.get_running_loop()
    start = next_at = loop.time()
    while next_at - start < seconds:
        delay = next_at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
        next_at += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    return latencies


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000, method="inclusive")[int(q * 10) - 1]


async def measure(direct: str, gateway: str, gateway_pid: int, args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    results: dict[str, list[float]] = {"direct": [], "gateway": []}
    gateway_cpu_s = 0.0
    rounds = []
    # Idle connections are dropped before the servers' keep-alive (5 s) ends: a block as long as that would
    # otherwise reuse connections at the moment the server closes them.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as client:
        for base in (direct, gateway):  # warm-up: connections, caches
            await block(client, f"{base}/v1/chat/completions", args.rate, 1.0, args.stream, rng)
        for n in range(args.rounds):
            order = [("direct", direct), ("gateway", gateway)]
            if n % 2:
                order.reverse()
            this_round = {}
            for arm, base in order:
                cpu_before = cpu_seconds(gateway_pid)
                latencies = await block(client, f"{base}/v1/chat/completions", args.rate, args.block_s,
                                        args.stream, rng)
                if arm == "gateway":
                    gateway_cpu_s += cpu_seconds(gateway_pid) - cpu_before
                results[arm] += latencies
                this_round[arm] = statistics.median(latencies)
            rounds.append(this_round)
            print(f"round {n + 1}: p50 direct {this_round['direct']:.3f} ms, gateway {this_round['gateway']:.3f} ms",
                  flush=True)
    summary = {arm: {"requests": len(values), "p50_ms": percentile(values, 50), "p99_ms": percentile(values, 99)}
               for arm, values in results.items()}
    summary["added"] = {
        "p50_ms": summary["gateway"]["p50_ms"] - summary["direct"]["p50_ms"],
        "p99_ms": summary["gateway"]["p99_ms"] - summary["direct"]["p99_ms"],
        "p50_ms_median_of_rounds": statistics.median(r["gateway"] - r["direct"] for r in rounds),
        "gateway_cpu_ms_per_request": gateway_cpu_s * 1000 / len(results["gateway"]),
    }
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=200.0, help="requests per second (open loop)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--block-s", type=float, default=5.0)
    ap.add_argument("--stream", action="store_true", help="streamed requests (two events each)")
    ap.add_argument("--policy", default="prefix")
    ap.add_argument("--no-platform", action="store_true", help="the gateway routes only (keys, limits, metering off)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--serve-fake", type=int, default=None, help=argparse.SUPPRESS)  # the backend process
    args = ap.parse_args()
    if args.serve_fake is not None:
        import uvicorn

        config = uvicorn.Config(fake_backend, host="127.0.0.1", port=args.serve_fake, log_level="warning",
                                lifespan="on")
        server = uvicorn.Server(config)
        print(f"fake backend at http://127.0.0.1:{args.serve_fake}", flush=True)
        server.run()
        return 0
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    backend = [sys.executable, __file__, "--serve-fake", str(port)]
    with process(backend, r"fake backend at (http://\S+)") as (direct, _):
        gateway_command = [sys.executable, "-m", "llmserve.cli", "gateway", "--pool", f"{MODEL}={direct}",
                           "--policy", args.policy, "--port", "0", *(["--no-platform"] if args.no_platform else [])]
        with process(gateway_command, r"gateway at (http://\S+)/v1") as (gateway, gateway_pid):
            summary = asyncio.run(measure(direct, gateway, gateway_pid, args))
    summary["config"] = {"rate": args.rate, "rounds": args.rounds, "block_s": args.block_s, "stream": args.stream,
                         "policy": args.policy, "platform": not args.no_platform,
                         "cpus": os.cpu_count()}
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(summary, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
