"""Greedy tokens of `--quantization int8` on CPU with our int8 kernel against torch's int8 kernel (the path
before it), on a built-in model (default `small`), and where each parts from the exact weight-only result.

Both runs use the same int8 weights and bf16 activations; they differ in rounding only (the kernel applies
float32 scales to a float32 sum and rounds once, `_weight_int8pack_mm` takes its scales in bf16). The
reference is the same int8 model with float32 activations. Prompts are random token ids, one request at a
time, so a step never holds more than one row (the kernel's batch-1 case).

    python benchmarks/int8_greedy.py --prompts 12 --tokens 48
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from llmserve import LLM, SamplingParams
from llmserve.model import cpu_linear
from llmserve.model.builtin import ensure_default_model


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first differing token, or the length when none differs."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = str(ensure_default_model("llama", args.size))
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 8000) for _ in range(rng.randrange(4, 40))] for _ in range(args.prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)

    def greedy(llm: LLM) -> list[list[int]]:
        return [llm.generate([prompt], params)[0].outputs[0].token_ids for prompt in prompts]

    int8 = LLM(model, dtype="bfloat16", quantization="int8", kv_cache_memory=1 << 30)
    kernel = greedy(int8)
    cpu_linear.use_int8_kernel(False)
    torch_kernel = greedy(int8)
    cpu_linear.use_int8_kernel(True)
    exact = greedy(LLM(model, dtype="float32", quantization="int8", kv_cache_memory=1 << 30))

    same = sum(a == b for a, b in zip(kernel, torch_kernel, strict=True))
    print(f"our kernel and torch's int8 kernel: {same}/{len(prompts)} prompts give the same {args.tokens} tokens")
    for name, tokens in (("our kernel", kernel), ("torch's int8 kernel", torch_kernel)):
        parts = [first_difference(a, b) for a, b in zip(tokens, exact, strict=True)]
        print(f"{name}: first token differing from float32 activations at {parts} (mean {statistics.mean(parts):.1f})")


if __name__ == "__main__":
    main()
