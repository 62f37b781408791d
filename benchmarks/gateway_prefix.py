"""Multi-tenant shared prefixes through the gateway: cache-aware routing (`prefix`) against
`round_robin`, with one big replica as the reference for the prefix-cache hit rate.

Workload: `--tenants` tenants, each with its own system prompt of `--prefix-tokens` token ids, chosen
per request by a Zipf law (`--zipf`, tenant k has weight 1/k^s); each request is the tenant's prompt
plus `--suffix-tokens` ids of its own, streamed, `--max-tokens` out (completions with token-id prompts,
so every arm sees exactly the same tokens). Arrivals are open-loop Poisson at `--rate` per second.

Three arms, all on the built-in `small` model, in one run: `prefix` (a gateway over 3 replicas),
`round_robin` (another gateway over 3 other replicas), and `single` (one replica with the three's KV
cache together: what perfect sharing would reach). The request sequence is cut into blocks of
`--block` requests; each block goes to every arm in turn (the order rotating), so the arms see the
same sequence and the machine's drift falls on all alike.

Measured per arm: the prefix-cache hit rate (prompt tokens found cached / looked up, from the replicas'
`vllm:prefix_cache_*` counters), TTFT p50/p90 (request sent to first token event, at the client), and
how evenly the work spread (each replica's `vllm:num_requests_running`, sampled every 0.2 s while the
arm runs: the busiest replica's mean against the mean over replicas; and requests per replica).

    python benchmarks/gateway_prefix.py [--requests 240] [--rate 2] [--no-platform] [--json out.json]
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
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from llmserve.model.builtin import make_model

MODEL = "small"


class Process:
    """A process started at once; `url()` waits for the address it prints (the first group of `pattern`)."""

    def __init__(self, command: list[str], pattern: str) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self._found: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, args=(pattern,), daemon=True).start()

    def _read(self, pattern: str) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            match = re.search(pattern, line)
            if match and not self._ready.is_set():
                self._found.append(match.group(1))
                self._ready.set()

    def url(self, timeout: float = 300) -> str:
        if not self._ready.wait(timeout):
            raise RuntimeError(f"{' '.join(self.proc.args[:5])} did not start")
        return self._found[0]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def replica(model_dir: Path, blocks: int, max_model_len: int) -> Process:
    command = [sys.executable, "-m", "llmserve.cli", "serve", "--no-platform", "--model", str(model_dir),
               "--served-model-name", MODEL, "--port", "0", "--num-kv-blocks", str(blocks),
               "--max-model-len", str(max_model_len)]
    return Process(command, r"serving \S+ at (http://\S+)/v1")


def gateway(urls: list[str], policy: str, platform: bool) -> Process:
    command = [sys.executable, "-m", "llmserve.cli", "gateway", "--pool", f"{MODEL}={','.join(urls)}",
               "--policy", policy, "--port", "0", *([] if platform else ["--no-platform"])]
    return Process(command, r"gateway at (http://\S+)/v1")


@dataclass
class Arm:
    name: str
    url: str  # where requests go
    replicas: list[str]
    ttft_ms: list[float] = field(default_factory=list)
    running: dict[str, list[int]] = field(default_factory=dict)
    counters_before: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    counters_after: dict[str, tuple[float, float, float]] = field(default_factory=dict)


def scrape(client: httpx.Client, url: str) -> tuple[float, float, float, float]:
    """(running, prefix-cache queries, hits, requests finished) from a replica's /metrics."""
    values = {"vllm:num_requests_running": 0.0, "vllm:prefix_cache_queries": 0.0, "vllm:prefix_cache_hits": 0.0,
              "vllm:request_success": 0.0}
    for family in text_string_to_metric_families(client.get(f"{url}/metrics").text):
        if family.name in values:
            values[family.name] = sum(s.value for s in family.samples if not s.name.endswith("_created"))
    return (values["vllm:num_requests_running"], values["vllm:prefix_cache_queries"],
            values["vllm:prefix_cache_hits"], values["vllm:request_success"])


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[tuple[float, int, list[int]]]]:
    """The tenants' prefixes and the requests: (gap before it in s, tenant, prompt ids)."""
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(100, 8000) for _ in range(args.prefix_tokens)] for _ in range(args.tenants)]
    weights = [1 / (k + 1) ** args.zipf for k in range(args.tenants)]
    requests = []
    for _ in range(args.requests):
        tenant = rng.choices(range(args.tenants), weights)[0]
        suffix = [rng.randrange(100, 8000) for _ in range(args.suffix_tokens)]
        requests.append((rng.expovariate(args.rate), tenant, prefixes[tenant] + suffix))
    return prefixes, requests


async def run_block(arm: Arm, block: list[tuple[float, int, list[int]]], args: argparse.Namespace) -> None:
    stop = asyncio.Event()

    async def sample() -> None:
        async with httpx.AsyncClient(timeout=10) as client:
            while not stop.is_set():
                for url in arm.replicas:
                    text = (await client.get(f"{url}/metrics")).text
                    for family in text_string_to_metric_families(text):
                        if family.name == "vllm:num_requests_running":
                            arm.running.setdefault(url, []).append(int(sum(s.value for s in family.samples)))
                await asyncio.sleep(0.2)

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        started = time.perf_counter()
        first = None
        async with client.stream("POST", f"{arm.url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"{arm.name}: {response.status_code} {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.perf_counter()
        assert first is not None
        arm.ttft_ms.append((first - started) * 1000)

    sampler = asyncio.create_task(sample())
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        tasks = []
        for gap, _, prompt in block:
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(client, prompt)))
        await asyncio.gather(*tasks)
    stop.set()
    await sampler


def report(arm: Arm) -> dict:
    queries = sum(arm.counters_after[u][0] - arm.counters_before[u][0] for u in arm.replicas)
    hits = sum(arm.counters_after[u][1] - arm.counters_before[u][1] for u in arm.replicas)
    served = {u: arm.counters_after[u][2] - arm.counters_before[u][2] for u in arm.replicas}
    mean_running = {u: statistics.fmean(v) for u, v in arm.running.items()}
    overall = statistics.fmean(mean_running.values())
    ttft = sorted(arm.ttft_ms)
    return {
        "replicas": len(arm.replicas),
        "requests": len(ttft),
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "ttft_p50_ms": statistics.median(ttft),
        "ttft_p90_ms": ttft[int(0.9 * (len(ttft) - 1))],
        "mean_running_per_replica": list(mean_running.values()),
        "busiest_over_mean_running": max(mean_running.values()) / overall if overall else 0.0,
        "requests_per_replica": list(served.values()),
        "busiest_over_mean_requests": max(served.values()) / statistics.fmean(served.values()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a `small` checkpoint dir (default: made in a temp dir)")
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--suffix-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--rate", type=float, default=2.0, help="requests per second, per arm")
    ap.add_argument("--block", type=int, default=20, help="requests per block (arms alternate by block)")
    ap.add_argument("--kv-blocks", type=int, default=384,
                    help="KV blocks (16 tokens) per replica of the 3-replica arms; `single` gets 3x")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-platform", action="store_true",
                    help="the gateways route only (no keys, limits or metering), as the `single` arm's bare replica")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model_dir = Path(args.model) if args.model else make_model(Path(tempfile.mkdtemp(prefix="llmserve-small-")),
                                                               "llama", MODEL, 0)
    max_model_len = args.prefix_tokens + args.suffix_tokens + args.max_tokens + 16
    _, requests = workload(args)
    with ExitStack() as stack:
        started = [replica(model_dir, args.kv_blocks, max_model_len) for _ in range(6)]
        started.append(replica(model_dir, 3 * args.kv_blocks, max_model_len))
        for process in started:
            stack.callback(process.stop)
        urls = [process.url() for process in started]
        gateways = [gateway(urls[0:3], "prefix", not args.no_platform),
                    gateway(urls[3:6], "round_robin", not args.no_platform)]
        for process in gateways:
            stack.callback(process.stop)
        prefix_gateway, round_robin_gateway = (process.url() for process in gateways)
        arms = [Arm("prefix", prefix_gateway, urls[0:3]), Arm("round_robin", round_robin_gateway, urls[3:6]),
                Arm("single", urls[6], urls[6:7])]
        with httpx.Client(timeout=30) as client:
            for arm in arms:
                arm.counters_before = {u: scrape(client, u)[1:] for u in arm.replicas}
            blocks = [requests[i:i + args.block] for i in range(0, len(requests), args.block)]
            for n, block in enumerate(blocks):
                order = arms[n % len(arms):] + arms[:n % len(arms)]
                for arm in order:
                    started = time.monotonic()
                    asyncio.run(run_block(arm, block, args))
                    print(f"block {n + 1}/{len(blocks)} {arm.name}: {time.monotonic() - started:.1f} s, "
                          f"TTFT p50 so far {statistics.median(arm.ttft_ms):.0f} ms", flush=True)
            for arm in arms:
                arm.counters_after = {u: scrape(client, u)[1:] for u in arm.replicas}
    results = {arm.name: report(arm) for arm in arms}
    prefix, rr, single = results["prefix"], results["round_robin"], results["single"]
    results["goals"] = {
        "hit_rate_vs_single": prefix["prefix_cache_hit_rate"] / single["prefix_cache_hit_rate"],
        "ttft_p50_round_robin_over_prefix": rr["ttft_p50_ms"] / prefix["ttft_p50_ms"],
        "busiest_over_mean_running_prefix": prefix["busiest_over_mean_running"],
    }
    results["config"] = {key: value for key, value in vars(args).items() if key not in ("json", "model")}
    results["config"]["cpus"] = os.cpu_count()
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
