"""Tensor parallelism on this machine: decode speed over 2 ranks against 1, the same model and work, alternated.

Each measurement runs in its own process (`LLM` with `tensor_parallel_size`, rank 0 in that process): batch 1
(one 128-token prompt, 128 tokens out) and batch 16 (16 such prompts), output tokens/s, after a warm-up run.
On a CPU the ranks share the machine's cores and memory bandwidth (each rank gets cores / ranks threads), so this
measures what the split and the all-reduces cost, not what a second device would add.

    python benchmarks/tensor_parallel.py [--size small] [--rounds 2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT_TOKENS = 128
OUTPUT_TOKENS = 128


def measure(model_dir: str, ranks: int, dtype: str) -> dict[str, float]:
    from llmserve import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, tensor_parallel_size=ranks, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    prompts = [[(7 * i + j) % 900 + 5 for j in range(PROMPT_TOKENS)] for i in range(16)]
    llm.generate(prompts[:2], params)  # warm-up
    result = {}
    for batch in (1, 16):
        started = time.perf_counter()
        llm.generate(prompts[:batch], params)
        result[f"batch{batch}_tok_s"] = batch * OUTPUT_TOKENS / (time.perf_counter() - started)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--child", nargs=2, metavar=("MODEL_DIR", "RANKS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.dtype)))
        return
    from llmserve.model.builtin import make_model

    with tempfile.TemporaryDirectory() as directory:
        model_dir = str(make_model(Path(directory) / args.size, "llama", args.size, 0))
        results: dict[int, list[dict[str, float]]] = {1: [], 2: []}
        for _ in range(args.rounds):
            for ranks in (1, 2):
                child = subprocess.run([sys.executable, __file__, "--dtype", args.dtype, "--child", model_dir,
                                        str(ranks)], capture_output=True, text=True, check=True)
                results[ranks].append(json.loads(child.stdout.strip().splitlines()[-1]))
                print(f"tp {ranks}: {results[ranks][-1]}", flush=True)
        for key in ("batch1_tok_s", "batch16_tok_s"):
            one = sorted(r[key] for r in results[1])
            two = sorted(r[key] for r in results[2])
            ratios = [b / a for a, b in zip((r[key] for r in results[1]), (r[key] for r in results[2]), strict=True)]
            print(f"{key}: tp1 {one}, tp2 {two}, tp2/tp1 per round {[round(r, 2) for r in ratios]}")


if __name__ == "__main__":
    main()
