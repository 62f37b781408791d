"""Prefill/decode disaggregation against colocated replicas, on the same cores, in one run.

Two replicas of one model, each pinned to a core of its own (`taskset`, `--cpu-threads 1`), behind a gateway:
- `colocated`: `--pool m=A,B`: each replica prefills and decodes its own requests, so a long prompt's
  prefill chunks share steps with the other requests' decodes (the interference disaggregation removes);
- `disaggregated`: `--pool m=D --prefill-pool m=P`: P computes every long prompt and D pulls its KV over
  the KV side channel (`--kv-transfer`) and decodes, computing only the prompt's last block;
- `chunked-N` (with `--chunked-arm N`): colocated, each step's token budget cut to N
  (`--max-num-batched-tokens`), the other answer to the interference: a prompt's prefill in smaller
  chunks, each stalling the decodes less, over more steps.

The pairs are up at once (two replicas on each core per pair; an idle one costs nothing) and are driven in
alternating rounds with the same open-loop workload: Poisson arrivals at `--rate` requests/s for `--seconds`,
each a streamed chat with a unique prompt of about `--prompt-words` words and `--max-tokens` output tokens.
Per arm, over all rounds: TTFT, TPOT (mean time between a request's tokens after its first) and the longest
gap between two tokens of a request (a stall), as percentiles; output tokens/s; and goodput, the share of
requests that meet both `--slo-ttft` and `--slo-tpot`.

    python benchmarks/disaggregation.py [--size small] [--rate 1.5] [--seconds 40] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from gateway_prefix import Process
from prometheus_client.parser import text_string_to_metric_families

from llmserve.model.builtin import make_model

MODEL = "m"
WORDS = ("river", "engine", "harbour", "lantern", "orchard", "signal", "copper", "meadow", "quarry", "violet",
         "summit", "thread", "ledger", "canyon", "pillar", "socket", "marble", "fabric", "tunnel", "beacon")


def replica(model_dir: Path, core: int, args: argparse.Namespace, *extra: str) -> Process:
    command = [sys.executable, "-m", "llmserve.cli", "serve", "--no-platform", "--model", str(model_dir),
               "--served-model-name", MODEL, "--port", "0", "--cpu-threads", "1", "--dtype", args.dtype,
               "--max-model-len", str(args.max_model_len), "--num-kv-blocks", str(args.kv_blocks),
               "--max-waiting-requests", "100000", *extra]
    return Process(["taskset", "-c", str(core), *command], r"serving \S+ at (http://\S+)/v1")


def gateway(decode: list[str], prefill: list[str]) -> Process:
    command = [sys.executable, "-m", "llmserve.cli", "gateway", "--no-platform", "--port", "0",
               "--pool", f"{MODEL}={','.join(decode)}"]
    if prefill:
        command += ["--prefill-pool", f"{MODEL}={','.join(prefill)}", "--pd-min-prompt-chars", "1"]
    return Process(command, r"gateway at (http://\S+)/v1")


@dataclass
class Arm:
    name: str
    url: str
    replicas: list[str]
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    stall: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    failed: int = 0


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def one(client: httpx.AsyncClient, body: dict, arm: Arm) -> None:
    started = time.perf_counter()
    times: list[float] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            arm.failed += 1
            return
        async for line in response.aiter_lines():
            if line.startswith("data: {") and any(c["delta"].get("content") for c in json.loads(line[6:])["choices"]):
                times.append(time.perf_counter())
    if len(times) < 2:
        arm.failed += 1
        return
    arm.ttft.append(times[0] - started)
    arm.tpot.append((times[-1] - times[0]) / (len(times) - 1))
    arm.stall.append(max(b - a for a, b in zip(times, times[1:], strict=False)))
    arm.tokens += len(times)


async def drive(arm: Arm, args: argparse.Namespace, seed: int) -> None:
    rng = random.Random(seed)  # the same arrivals and prompts for both arms in a round
    arrivals, at = [], 0.0
    while at < args.seconds:
        arrivals.append(at)
        at += rng.expovariate(args.rate)
    bodies = [{"model": MODEL, "messages": [{"role": "user", "content": f"{seed}-{i} " + prompt(rng, args.prompt_words)}],
               "max_tokens": args.max_tokens, "ignore_eos": True, "stream": True} for i in range(len(arrivals))]
    async with httpx.AsyncClient(base_url=arm.url, timeout=600, limits=httpx.Limits(max_connections=1000)) as client:
        started = time.perf_counter()

        async def at_time(when: float, body: dict) -> None:
            await asyncio.sleep(max(0.0, started + when - time.perf_counter()))
            await one(client, body, arm)

        await asyncio.gather(*(at_time(when, body) for when, body in zip(arrivals, bodies, strict=True)))
        arm.seconds += time.perf_counter() - started


def counter(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else float("nan")


def summary(arm: Arm, args: argparse.Namespace) -> dict:
    good = sum(1 for t, p in zip(arm.ttft, arm.tpot, strict=True) if t <= args.slo_ttft and p <= args.slo_tpot)
    row = {"arm": arm.name, "requests": len(arm.ttft), "failed": arm.failed,
           "output_tok_s": round(arm.tokens / arm.seconds, 1) if arm.seconds else 0.0,
           "goodput": round(good / max(1, len(arm.ttft) + arm.failed), 3)}
    for label, values, scale in (("ttft_s", arm.ttft, 1), ("tpot_ms", arm.tpot, 1000), ("stall_ms", arm.stall, 1000)):
        for q in (50, 90, 99):
            row[f"{label}_p{q}"] = round(percentile(values, q) * scale, 3 if scale == 1 else 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", help="the built-in Llama's size (tiny, small, medium)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rate", type=float, default=1.5, help="requests/s (Poisson)")
    ap.add_argument("--seconds", type=float, default=40.0, help="arrivals per round last this long")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-words", type=int, default=400, help="about 1,100 tokens of the built-in tokenizer")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-blocks", type=int, default=4096)
    ap.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=0.05, help="seconds")
    ap.add_argument("--chunked-arm", type=int, default=0, metavar="N",
                    help="add a colocated arm whose steps take at most N tokens (0: none)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / args.size, "llama", args.size, 0)
        # The colocated pair, then the disaggregated one: P on core 0, D on core 1.
        transfer = ("--kv-transfer", "--kv-transfer-host", "127.0.0.1")
        pairs = {"colocated": [replica(model_dir, core, args) for core in (0, 1)],
                 "disaggregated": [replica(model_dir, core, args, *transfer) for core in (0, 1)]}
        if args.chunked_arm:
            chunk = ("--max-num-batched-tokens", str(args.chunked_arm))
            pairs[f"chunked-{args.chunked_arm}"] = [replica(model_dir, core, args, *chunk) for core in (0, 1)]
        for process in (p for pair in pairs.values() for p in pair):
            stack.callback(process.stop)
        urls = {name: [p.url() for p in pair] for name, pair in pairs.items()}
        prefill_url, decode_url = urls["disaggregated"]
        gateways = {name: gateway([decode_url], [prefill_url]) if name == "disaggregated" else gateway(pair, [])
                    for name, pair in urls.items()}
        for process in gateways.values():
            stack.callback(process.stop)
        arms = [Arm(name, process.url(), urls[name]) for name, process in gateways.items()]
        for round_ in range(args.rounds):
            for arm in arms if round_ % 2 == 0 else arms[::-1]:
                asyncio.run(drive(arm, args, seed=round_))
                print(f"round {round_} {arm.name}: {summary(arm, args)}", file=sys.stderr, flush=True)
        moved = {"blocks_sent": counter(prefill_url, "llmserve:kv_transfer_blocks_total", direction="sent"),
                 "blocks_received": counter(decode_url, "llmserve:kv_transfer_blocks_total", direction="received"),
                 "pulls_failed": counter(decode_url, "llmserve:kv_transfer_pulls_failed_total")}
    rows = [summary(arm, args) for arm in arms]
    result = {"workload": vars(args), "machine": os.cpu_count(), "arms": rows, "transfer": moved}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
