"""What a key tier's priority (the config's `tiers`) buys under overload: the time to first token and the
latency of a `gold` key's requests while `free` keys keep the server saturated, on a server scheduling by
priority with tiers {gold: -10, free: 10}, against the same server first come, first served, in one run.

Both servers run at once (the idle one costs nothing) and are driven in alternating rounds: in each,
`--free-clients` streams of a free key run back to back (more than `--max-num-seqs`, so requests queue)
while one gold client sends a request, waits for its end, and sends the next. Per tier: TTFT and latency
percentiles over all rounds, and the free tier's output tokens/s (what the priority costs it).

With `--max-waiting-requests N` the servers shed (503) what finds N requests ahead of it; a shed client waits
its Retry-After, and each tier's shed requests are counted.

    python benchmarks/tier_priority.py [--size small] [--rounds 2] [--seconds 30] [--max-waiting-requests N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
from platform_overhead import percentile, server

TIERS = "tiers:\n  gold: {priority: -10}\n  free: {priority: 10}\n"


def chat(i: int, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Request {i}: tell me about the weather in a long answer."}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def one_stream(client: httpx.AsyncClient, body: dict) -> tuple[float, float, int] | float:
    """(TTFT s, latency s, completion tokens) of one streamed chat, or its Retry-After (s) when it is shed (503)."""
    started = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code == 503:
            await response.aread()
            return float(response.headers.get("retry-after", "1"))
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if first is None and event["choices"] and event["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    ended = time.perf_counter()
    return (first or ended) - started, ended - started, tokens


async def drive(url: str, keys: dict[str, str], args: argparse.Namespace) -> dict[str, list]:
    """Each tier's finished requests (TTFT, latency, tokens), and a None for each request shed."""
    results: dict[str, list] = {"gold": [], "free": []}
    deadline = time.perf_counter() + args.seconds
    limits = httpx.Limits(max_connections=args.free_clients + 4)

    async def client_loop(tier: str, client: httpx.AsyncClient, max_tokens: int) -> None:
        i = 0
        while time.perf_counter() < deadline:
            outcome = await one_stream(client, chat(i, max_tokens))
            if isinstance(outcome, float):  # shed: wait as told, as a client honouring Retry-After does
                results[tier].append(None)
                await asyncio.sleep(outcome)
            else:
                results[tier].append(outcome)
            i += 1

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits,
                                 headers={"Authorization": f"Bearer {keys['free']}"}) as free, \
            httpx.AsyncClient(base_url=url, timeout=600,
                              headers={"Authorization": f"Bearer {keys['gold']}"}) as gold:
        await asyncio.gather(*(client_loop("free", free, args.free_tokens) for _ in range(args.free_clients)),
                             client_loop("gold", gold, args.gold_tokens))
    return results


def summary(outcomes: list, seconds: float) -> dict:
    samples = [s for s in outcomes if s is not None]
    ttft = [s[0] * 1000 for s in samples] or [float("nan")]
    latency = [s[1] * 1000 for s in samples] or [float("nan")]
    return {"requests": len(samples), "shed": len(outcomes) - len(samples),
            "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p90": percentile(ttft, 90),
            "latency_ms_p50": percentile(latency, 50), "latency_ms_p90": percentile(latency, 90),
            "output_tok_s": sum(s[2] for s in samples) / seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", choices=("tiny", "small", "medium"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--free-clients", type=int, default=12)
    parser.add_argument("--free-tokens", type=int, default=64)
    parser.add_argument("--gold-tokens", type=int, default=16)
    parser.add_argument("--max-waiting-requests", type=int, default=None,
                        help="the servers' queue limit; past it a request is shed with 503 (default: none)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from llmserve.model.builtin import make_model
    from llmserve.platform.keys import KeyStore
    from llmserve.store.db import open_database

    with tempfile.TemporaryDirectory() as tmp, ExitStack() as servers:
        model = str(make_model(Path(tmp) / args.size, "llama", args.size, 0))
        config = Path(tmp) / "tiers.yaml"
        config.write_text(TIERS)
        urls: dict[str, str] = {}
        keys: dict[str, dict[str, str]] = {}
        for name, extra in (("priority + tiers", ["--scheduling-policy", "priority", "--config", str(config)]),
                            ("fcfs", ["--scheduling-policy", "fcfs"])):
            database_url = f"sqlite:///{Path(tmp) / (name.split()[0] + '.db')}"
            database = open_database(database_url)
            store = KeyStore(database)
            keys[name] = {tier: store.create(tier, tier=tier)[1] for tier in ("gold", "free")}
            database.dispose()
            urls[name] = servers.enter_context(server(
                model, "--database-url", database_url, "--max-num-seqs", str(args.max_num_seqs),
                "--usage-journal", str(Path(tmp) / (name.split()[0] + "-journal")), "--dtype", "bfloat16", *extra,
                *(["--max-waiting-requests", str(args.max_waiting_requests)] if args.max_waiting_requests else []),
            ))
        samples: dict[str, dict[str, list]] = {name: {"gold": [], "free": []} for name in urls}
        for round_index in range(args.rounds):
            for name in (list(urls) if round_index % 2 == 0 else list(reversed(urls))):
                for tier, values in asyncio.run(drive(urls[name], keys[name], args)).items():
                    samples[name][tier].extend(values)
    seconds = args.seconds * args.rounds
    result = {
        "model": f"built-in {args.size} llama, bfloat16",
        "workload": (f"{args.free_clients} free clients x {args.free_tokens} tokens out, back to back; one gold client "
                     f"x {args.gold_tokens} tokens; --max-num-seqs {args.max_num_seqs}; "
                     f"--max-waiting-requests {args.max_waiting_requests or 'unlimited'}; "
                     f"{args.rounds} rounds of {args.seconds:.0f} s per server"),
        "servers": {name: {tier: summary(values, seconds) for tier, values in tiers.items()}
                    for name, tiers in samples.items()},
    }
    print(json.dumps(result, indent=2))
    print()
    print("| server | tier | requests | shed | TTFT p50 ms | TTFT p90 ms | latency p50 ms | latency p90 ms "
          "| output tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, tiers in result["servers"].items():
        for tier, s in tiers.items():
            print(f"| {name} | {tier} | {s['requests']} | {s['shed']} | {s['ttft_ms_p50']:.0f} | {s['ttft_ms_p90']:.0f} | "
                  f"{s['latency_ms_p50']:.0f} | {s['latency_ms_p90']:.0f} | {s['output_tok_s']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
