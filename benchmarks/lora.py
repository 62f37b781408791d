"""What serving LoRA adapters costs: one engine with --enable-lora, requests of the base model against the same
requests through adapters (PEFT's layout, random A and B, every linear layer adapted), alternated round by round.

Workloads, each timed whole (`LLM.generate`, one call):
  - batch 1: one prompt of 128 tokens, 128 tokens out; base, then through one adapter (tok/s of the output);
  - batch N (--batch, 16): N prompts of 128 tokens, 128 out each; all base, then each through one of
    --adapters (4) adapters in turn, every adapter in every step (output tok/s).
A step with an adapter runs the per-module forward pass (the one-call CPU decoder and CUDA graphs have no LoRA).

    python benchmarks/lora.py --size medium --rounds 3 [--rank 16] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmserve import LLM, LoRARequest, SamplingParams  # noqa: E402
from llmserve.model.builtin import make_model  # noqa: E402
from tests.hf_reference import build_lora_adapter  # noqa: E402


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def _output_rate(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="medium", choices=("tiny", "small", "medium"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = make_model(Path(tmp) / "base", "llama", args.size, 0)
        dirs = [build_lora_adapter(base, Path(tmp) / f"adapter{i}", rank=args.rank, alpha=2 * args.rank, seed=i + 1)
                for i in range(args.adapters)]
        llm = LLM(str(base), dtype=args.dtype, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
                  max_num_seqs=max(args.batch, 8))
        vocab = llm.engine.facts.model_config.vocab_size
        adapters = [LoRARequest(f"adapter{i}", i + 1, str(d)) for i, d in enumerate(dirs)]
        one = _prompts(1, 128, vocab, seed=0)
        batch = _prompts(args.batch, 128, vocab, seed=1)
        mixed = [adapters[i % len(adapters)] for i in range(args.batch)]
        _output_rate(llm, one, [adapters[0]], 8)  # warm-up: the adapter read, the kernels built
        rates: dict[str, list[float]] = {"batch 1, base": [], "batch 1, adapter": [],
                                         f"batch {args.batch}, base": [], f"batch {args.batch}, adapters": []}
        for round_ in range(args.rounds):
            rates["batch 1, base"].append(_output_rate(llm, one, [None], args.max_tokens))
            rates["batch 1, adapter"].append(_output_rate(llm, one, [adapters[0]], args.max_tokens))
            rates[f"batch {args.batch}, base"].append(_output_rate(llm, batch, [None] * args.batch, args.max_tokens))
            rates[f"batch {args.batch}, adapters"].append(_output_rate(llm, batch, mixed, args.max_tokens))
            print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()), flush=True)
    median = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\nllama {args.size}, {args.dtype}, rank {args.rank}, {args.adapters} adapters, every linear layer adapted; "
          f"{os.cpu_count()} CPUs; medians of {args.rounds} rounds (output tok/s):")
    for key, value in median.items():
        print(f"  {key:<24} {value:8.1f}")
    print(f"  adapter / base, batch 1: {median['batch 1, adapter'] / median['batch 1, base']:.2f}x; "
          f"batch {args.batch}: {median[f'batch {args.batch}, adapters'] / median[f'batch {args.batch}, base']:.2f}x")


if __name__ == "__main__":
    main()
