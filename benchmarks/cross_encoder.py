"""A cross-encoder reranker served by llmserve against sentence-transformers' CrossEncoder on the same weights:
a random checkpoint written by transformers, by default ms-marco-MiniLM-L-6-v2-shaped (BertForSequenceClassification,
6 layers, hidden 384, one label; `--kind xlm-roberta --size base`: bge-reranker-base's layout and shape, 12
layers, hidden 768, on a WordPiece vocabulary), one query of 8-24 tokens against N documents of 8-100 tokens (every pair fits
the model's 128). Alternately, one `/v1/rerank`
request to `llmserve serve` and one `CrossEncoder.predict` of the same pairs in this process (batch 32, as
sentence-transformers' default); the medians of their times, the ratio, and the largest score difference.

    python benchmarks/cross_encoder.py --documents 100 --rounds 10 [--kind xlm-roberta --size base]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from embeddings import MODEL, Server, make_texts  # noqa: E402

from tests.hf_reference import build_cross_encoder  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--documents", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kind", choices=("bert", "xlm-roberta"), default="bert")
    ap.add_argument("--size", choices=("minilm", "base"), default="minilm")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="the server's (default: its own)")
    args = ap.parse_args(argv)
    import torch
    from sentence_transformers import CrossEncoder

    from llmserve.model.loader import resolve_model_path
    from llmserve.tokenizer.tokenizer import Tokenizer

    wordpiece = resolve_model_path(MODEL)
    tokenizer = Tokenizer.from_pretrained(str(wordpiece))
    query = make_texts(tokenizer, 1, 8, 24, seed=1)[0]
    documents = make_texts(tokenizer, args.documents, 8, 100, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_cross_encoder(args.kind, Path(tmp) / "reranker", wordpiece, size=args.size)
        reference = CrossEncoder(str(model_dir), device="cpu", max_length=128)
        if args.dtype == "bfloat16":
            reference.model.to(torch.bfloat16)
        budget = [] if args.max_num_batched_tokens is None else ["--max-num-batched-tokens",
                                                                 str(args.max_num_batched_tokens)]
        server = Server(args.dtype, ["--no-platform", *budget], model=str(model_dir))
        times: dict[str, list[float]] = {"llmserve": [], "sentence-transformers": []}
        try:
            with httpx.Client(base_url=server.url, timeout=600) as client:

                def llmserve() -> list[float]:
                    response = client.post("/v1/rerank", json={"query": query, "documents": documents})
                    response.raise_for_status()
                    scores = {r["index"]: r["relevance_score"] for r in response.json()["results"]}
                    return [scores[i] for i in range(len(documents))]

                runs = {"llmserve": llmserve, "sentence-transformers":
                        lambda: reference.predict([(query, d) for d in documents], batch_size=32).tolist()}
                scores: dict[str, list[float]] = {}
                for round_ in range(args.rounds + 1):  # the first round warms up
                    for name in (("llmserve", "sentence-transformers") if round_ % 2 else
                                 ("sentence-transformers", "llmserve")):
                        start = time.perf_counter()
                        scores[name] = runs[name]()
                        if round_:
                            times[name].append((time.perf_counter() - start) * 1e3)
        finally:
            server.close()
    ours, theirs = statistics.median(times["llmserve"]), statistics.median(times["sentence-transformers"])
    difference = float(np.abs(np.subtract(scores["llmserve"], scores["sentence-transformers"])).max())
    print(f"random {args.kind} cross-encoder of the {args.size} shape ({args.dtype}), 1 query + {args.documents} documents of "
          f"8-100 tokens, {platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
          f"median of {args.rounds} alternated rounds, the server's --max-num-batched-tokens "
          f"{args.max_num_batched_tokens or 'default'}")
    print(f"| llmserve /v1/rerank | {ours:.1f} ms | {args.documents / ours * 1e3:.0f} pairs/s |")
    print(f"| sentence-transformers CrossEncoder.predict | {theirs:.1f} ms | {args.documents / theirs * 1e3:.0f} pairs/s |")
    print(f"| sentence-transformers / llmserve time | {theirs / ours:.2f}x |")
    print(f"| largest score difference | {difference:.2e} |")


if __name__ == "__main__":
    main()
