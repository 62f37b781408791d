"""The int8 KV cache on CPU (`--kv-cache-dtype int8`) against bf16: decode attention alone and decode steps.

1. Attention alone: one decode step's attention over 24 layers' caches in turn (the built-in `medium` model's
   shape: 16 heads / 8 KV heads, head dim 64, block size 16, blocks shuffled), the same values stored in bf16
   and in int8, on the AVX-512 and the portable C implementation, alternating; the fastest of --rounds, in ms.
2. Decode steps of the `medium` model (bf16 weights), one engine with each KV cache dtype in one process,
   alternating: the median decode step (ms) of N sequences decoding together after prompts of P tokens each,
   and the tokens each pool holds in the same memory.

    python benchmarks/cpu_kv_cache.py --rounds 7 --engine-rounds 3 --json bench_out/cpu_kv_cache.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from llmserve import LLM, SamplingParams
from llmserve.model.attention import cpu_kernels, int8_kv
from llmserve.model.builtin import ensure_default_model

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 16, 8, 64, 16, 24
KERNEL_SHAPES = [(1, 4000), (1, 1000), (8, 1024), (64, 256)]  # (sequences, context)
ENGINE_SHAPES = [(1, 3900), (1, 1000), (1, 128), (8, 1024)]
KV_DTYPES = ("auto", "int8")


def layer_caches(blocks: int, gen: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """One layer's keys and values, random, as a bf16 cache and the same rows written into an int8 cache."""
    pair = {"auto": [], "int8": []}
    for _ in range(2):
        values = torch.randn(blocks, KV_HEADS, BLOCK, HEAD_DIM, generator=gen).to(torch.bfloat16)
        quantized = torch.zeros(int8_kv.cache_shape(blocks, KV_HEADS, BLOCK, HEAD_DIM), dtype=torch.int8)
        rows = values.transpose(1, 2).reshape(-1, KV_HEADS, HEAD_DIM)
        int8_kv.write(quantized, torch.arange(blocks).repeat_interleave(BLOCK), torch.arange(BLOCK).repeat(blocks), rows)
        pair["auto"].append(values)
        pair["int8"].append(quantized)
    return {name: tuple(caches) for name, caches in pair.items()}


def kernel_case(batch: int, context: int, rounds: int, gen: torch.Generator) -> dict:
    per_seq = -(-context // BLOCK)
    layers = [layer_caches(batch * per_seq, gen) for _ in range(LAYERS)]
    tables = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    best: dict[str, float] = {}
    for _ in range(rounds):
        for portable in (False, True):
            for kv in KV_DTYPES:
                start = time.perf_counter()
                for caches in layers:
                    k_cache, v_cache = caches[kv]
                    cpu_kernels.paged_decode(query, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5, portable=portable)
                key = f"{'portable' if portable else 'avx512'}_{kv}_ms"
                best[key] = min(best.get(key, float("inf")), (time.perf_counter() - start) * 1e3)
    return {"batch": batch, "context": context, **best}


def decode_step_ms(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    """Median wall time of the decode steps of `prompts` decoding together (prefill steps left out)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"kv-{time.monotonic_ns()}-{i}", prompt, params)
    started: set[str] = set()
    while len(started) < len(prompts):
        started |= {out.request_id for out in engine.step() if out.outputs[0].token_ids}
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return statistics.median(steps[:-1]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7, help="alternations in part 1 (the fastest is kept)")
    ap.add_argument("--engine-rounds", type=int, default=3, help="alternations in part 2 (medians reported)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if cpu_kernels.load() is None:
        raise SystemExit("the CPU kernel could not be built here")

    gen = torch.Generator().manual_seed(0)
    print(f"one decode step's attention ({LAYERS} layers' caches in turn), ms, bf16 cache / int8 cache:")
    kernel_rows = []
    for batch, context in KERNEL_SHAPES:
        row = kernel_case(batch, context, args.rounds, gen)
        kernel_rows.append(row)
        print(f"  {batch:3d} x {context:5d} tokens: " + "  ".join(
            f"{impl} {row[f'{impl}_auto_ms']:7.2f} / {row[f'{impl}_int8_ms']:7.2f} "
            f"({row[f'{impl}_auto_ms'] / row[f'{impl}_int8_ms']:.2f}x)" for impl in ("avx512", "portable")))

    engine_rows = []
    if not args.skip_engine:
        model_dir = str(ensure_default_model("llama", "medium"))
        llms = {kv: LLM(model_dir, dtype="bfloat16", kv_cache_memory=2 << 30, kv_cache_dtype=kv,
                        enable_prefix_caching=False) for kv in KV_DTYPES}
        pool = {kv: llm.engine.core.runner.num_blocks * llm.engine.core.runner.block_size for kv, llm in llms.items()}
        print(f"KV pool in 2 GiB: bf16 {pool['auto']} tokens, int8 {pool['int8']} tokens "
              f"({pool['int8'] / pool['auto']:.2f}x)")
        rng = random.Random(0)
        for llm in llms.values():
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        for batch, context in ENGINE_SHAPES:
            times: dict[str, list[float]] = {kv: [] for kv in KV_DTYPES}
            for _ in range(args.engine_rounds):
                prompts = [[rng.randrange(10, 31990) for _ in range(context)] for _ in range(batch)]
                for kv, llm in llms.items():
                    times[kv].append(decode_step_ms(llm, prompts, args.new_tokens))
            row = {"batch": batch, "context": context, **{f"{kv}_step_ms": statistics.median(t) for kv, t in times.items()},
                   **{f"{kv}_runs_ms": t for kv, t in times.items()}}
            engine_rows.append(row)
            print(f"  decode step, {batch} x {context} tokens: bf16 KV {row['auto_step_ms']:.1f} ms, int8 KV "
                  f"{row['int8_step_ms']:.1f} ms ({row['auto_step_ms'] / row['int8_step_ms']:.2f}x); "
                  f"runs {[round(t, 1) for t in times['auto']]} / {[round(t, 1) for t in times['int8']]}")
        engine_rows.append({"pool_tokens": pool})
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"threads": torch.get_num_threads(), "kernel": kernel_rows,
                                         "engine": engine_rows}, indent=2))


if __name__ == "__main__":
    main()
