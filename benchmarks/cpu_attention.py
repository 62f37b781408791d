"""CPU decode attention: the AVX-512 kernel against the portable C one, alone and inside the engine.

1. The kernel alone, on paged bf16 caches in the medium model's shape (16 heads / 8 KV heads, head
   dim 64, block size 16, blocks shuffled): ms per call and the KV bytes read per second.
2. One decode step's attention: the kernel over 24 layers' caches in turn (more than the caches hold, as in a
   step), built with its KV prefetch (KV_PREFETCH_BLOCKS, --kv-prefetch-blocks) and without it, alternating:
   ms per step.
3. The engine saturated offline (the serving benchmark's workload shape: random prompts of 32-256
   tokens, 16-128 output tokens, all at once), once per implementation, alternating, in one process:
   output tokens/s, and the time spent in decode attention.

    python benchmarks/cpu_attention.py [--model DIR] [--requests 128] [--rounds 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import re
import statistics
import time

import torch

from llmserve.engine.llm_engine import LLMEngine
from llmserve.model.attention import cpu_kernels, torch_ref
from llmserve.model.builtin import ensure_default_model
from llmserve.sampling.params import SamplingParams

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 64, 16
SHAPES = [(1, 4000), (8, 1024), (32, 512), (128, 200), (256, 300)]  # (batch, context)
IMPLEMENTATIONS = {"portable": True, "avx512": False}
STEP_SHAPES = [(1, 4000), (1, 1000), (8, 1024), (64, 256)]  # (batch, context) for part 2
DEFAULT_KV_PREFETCH_BLOCKS = int(re.search(r"#define KV_PREFETCH_BLOCKS (\d+)", cpu_kernels.SOURCE.read_text())[1])
LAYERS = 24


def kernel_case(batch: int, context: int, gen: torch.Generator) -> dict[str, float]:
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq
    shape = (num_blocks, KV_HEADS, BLOCK, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    v_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * 2
    row: dict[str, float] = {"batch": batch, "context": context}
    for name, portable in IMPLEMENTATIONS.items():
        def call(portable: bool = portable) -> torch.Tensor:
            return cpu_kernels.paged_decode(query, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5, portable=portable)
        for _ in range(3):
            call()
        times = []
        for _ in range(20):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        row[f"{name}_ms"] = seconds * 1e3
        row[f"{name}_gb_s"] = kv_bytes / seconds / 1e9
    row["speedup"] = row["portable_ms"] / row["avx512_ms"]
    return row


def step_case(batch: int, context: int, libs: dict[str, ctypes.CDLL], rounds: int, gen: torch.Generator) -> dict:
    """Part 2: ms of one pass of the kernel over LAYERS layers' caches, per library and implementation."""
    per_seq = -(-context // BLOCK)
    shape = (batch * per_seq, KV_HEADS, BLOCK, HEAD_DIM)
    caches = [(torch.randn(shape, generator=gen).to(torch.bfloat16), torch.randn(shape, generator=gen).to(torch.bfloat16))
              for _ in range(LAYERS)]
    tables = torch.randperm(batch * per_seq, generator=gen).view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    out = torch.empty_like(query)
    kv_bytes = LAYERS * 2 * batch * context * KV_HEADS * HEAD_DIM * 2
    best: dict[str, float] = {}
    for _ in range(rounds):
        for lib_name, lib in libs.items():
            for impl, portable in IMPLEMENTATIONS.items():
                fn = lib.llmserve_paged_decode_portable if portable else lib.llmserve_paged_decode
                start = time.perf_counter()
                for k_cache, v_cache in caches:
                    fn(1, query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                       out.data_ptr(), batch, HEADS, KV_HEADS, HEAD_DIM, BLOCK, per_seq, HEAD_DIM**-0.5,
                       torch.get_num_threads())
                key = f"{impl}_{lib_name}"
                best[key] = min(best.get(key, float("inf")), time.perf_counter() - start)
    row: dict = {"batch": batch, "context": context}
    for key, seconds in best.items():
        row[f"{key}_ms"] = seconds * 1e3
        row[f"{key}_gb_s"] = kv_bytes / seconds / 1e9
    return row


def prefetch_variants(distances: list[int]) -> dict[str, ctypes.CDLL]:
    """The kernel built with each KV_PREFETCH_BLOCKS in `distances` (0: no prefetch), keyed "prefetch<N>"."""
    return {f"prefetch{blocks}": cpu_kernels.load((f"KV_PREFETCH_BLOCKS={blocks}",)) for blocks in distances}


class DecodeTimer:
    """Wraps the backend's decode so the engine run reports the seconds spent in it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._inner = torch_ref.TorchAttentionBackend._decode

    def __enter__(self) -> DecodeTimer:
        inner, timer = self._inner, self

        def timed(backend, *args):
            start = time.perf_counter()
            out = inner(backend, *args)
            timer.seconds += time.perf_counter() - start
            return out

        torch_ref.TorchAttentionBackend._decode = timed
        return self

    def __exit__(self, *exc: object) -> None:
        torch_ref.TorchAttentionBackend._decode = self._inner


def engine_run(engine: LLMEngine, requests: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    output_tokens = 0
    for i in range(requests):
        prompt = [rng.randrange(100, 30000) for _ in range(rng.randint(32, 256))]
        max_tokens = rng.randint(16, 128)
        output_tokens += max_tokens
        engine.add_request(f"{seed}-{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0))
    with DecodeTimer() as timer:
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tok_s": output_tokens / elapsed, "decode_attention_s": timer.seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: built-in llama medium)")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1, help="engine runs per implementation")
    ap.add_argument("--step-rounds", type=int, default=7, help="alternations in part 2 (the fastest is kept)")
    ap.add_argument("--kv-prefetch-blocks", default=f"0,{DEFAULT_KV_PREFETCH_BLOCKS}",
                    help="part 2's builds: KV_PREFETCH_BLOCKS values, comma-separated (0: none)")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if cpu_kernels.load() is None:
        raise SystemExit("the CPU kernel could not be built here")

    gen = torch.Generator().manual_seed(0)
    kernel_rows = [kernel_case(batch, context, gen) for batch, context in SHAPES]
    print("decode attention kernel alone (bf16, 16/8 heads, dim 64, block 16):")
    for row in kernel_rows:
        print(f"  batch {row['batch']:4d} x {row['context']:5d} tokens: portable {row['portable_ms']:7.3f} ms "
              f"({row['portable_gb_s']:5.1f} GB/s)  avx512 {row['avx512_ms']:7.3f} ms ({row['avx512_gb_s']:5.1f} GB/s)"
              f"  {row['speedup']:.2f}x")

    distances = [int(d) for d in args.kv_prefetch_blocks.split(",")]
    libs = prefetch_variants(distances)
    step_rows = [step_case(batch, context, libs, args.step_rounds, gen) for batch, context in STEP_SHAPES]
    print(f"one decode step's attention ({LAYERS} layers' caches in turn), ms, by KV_PREFETCH_BLOCKS "
          f"({', '.join(map(str, distances))}; the build default is {DEFAULT_KV_PREFETCH_BLOCKS}):")
    for row in step_rows:
        print(f"  batch {row['batch']:4d} x {row['context']:5d} tokens: " + "  ".join(
            f"{impl} " + " / ".join(f"{row[f'{impl}_prefetch{d}_ms']:.2f}" for d in distances)
            for impl in IMPLEMENTATIONS))

    engine_rows: dict[str, list[dict[str, float]]] = {name: [] for name in IMPLEMENTATIONS}
    if not args.skip_engine:
        # Prefix caching off: every run sends the same prompts, and a later run must not reuse an earlier one's KV.
        engine = LLMEngine.from_args(args.model or ensure_default_model("llama", "medium"), max_num_batched_tokens=2048,
                                     enable_prefix_caching=False)
        engine_run(engine, 8, seed=99)  # warm-up
        for round_index in range(args.rounds):
            for name, portable in IMPLEMENTATIONS.items():
                cpu_kernels.use_portable(portable)
                result = engine_run(engine, args.requests, seed=round_index)
                engine_rows[name].append(result)
                print(f"engine, {args.requests} requests at once, {name}: {result['output_tok_s']:.1f} output tok/s, "
                      f"{result['seconds']:.1f} s, of which decode attention {result['decode_attention_s']:.1f} s")
        cpu_kernels.use_portable(False)
        pairs = zip(engine_rows["avx512"], engine_rows["portable"], strict=True)
        ratios = [fast["output_tok_s"] / slow["output_tok_s"] for fast, slow in pairs]
        print(f"engine throughput, avx512 / portable: {statistics.median(ratios):.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernel": kernel_rows, "step": step_rows, "engine": engine_rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
