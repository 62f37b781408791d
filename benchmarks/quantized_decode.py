"""CPU batch-1 decode with int8 weights against bf16, on the built-in `medium` model, in one run.

1. Linear layers: `torch._weight_int8pack_mm` (the int8 kernel `--quantization int8` runs on CPU)
   against bf16 `F.linear`, at M = 1, 2, 4, 8 rows for each of the medium model's projection shapes;
   the two alternate, ROUNDS times, and the median of each is reported.
2. The offline engine: `LLM(medium, dtype=bfloat16)` and `LLM(..., quantization="int8")`, both loaded;
   one request at a time (batch 1: a PROMPT-token prompt, MAX_TOKENS greedy tokens, ignore_eos),
   alternating between the two, ROUNDS times. Decode tok/s = (MAX_TOKENS - 1) / (time of the request
   minus the time of a 1-token request with the same prompt, both medians): prefill excluded.

    python benchmarks/quantized_decode.py --json bench_out/quantized_decode.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from llmserve import LLM, SamplingParams
from llmserve.model.builtin import ensure_default_model
from llmserve.model.quantization.int8 import quantize_int8

# (out, in) of the medium model's linear layers
MEDIUM_SHAPES = {"qkv_proj": (2048, 1024), "o_proj": (1024, 1024), "gate_up_proj": (5632, 1024),
                 "down_proj": (1024, 2816)}


def _time(fn: Callable[[], object], reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def bench_linear(rounds: int, reps: int) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in MEDIUM_SHAPES.items():
        weight = (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
        q, scale = quantize_int8(weight)
        scale = scale.bfloat16()
        for m in (1, 2, 4, 8):
            x = torch.randn(m, k, generator=gen).bfloat16()
            bf16, int8 = [], []
            for _ in range(rounds):
                bf16.append(_time(lambda: torch.nn.functional.linear(x, weight), reps))  # noqa: B023
                int8.append(_time(lambda: torch._weight_int8pack_mm(x, q, scale), reps))  # noqa: B023
            row = {"layer": name, "n": n, "k": k, "m": m, "bf16_us": 1e6 * statistics.median(bf16),
                   "int8_us": 1e6 * statistics.median(int8)}
            row["speedup"] = row["bf16_us"] / row["int8_us"]
            rows.append(row)
            print(f"{name:>13} N={n:<5} K={k:<5} M={m}: bf16 {row['bf16_us']:8.1f} us  int8 {row['int8_us']:8.1f} us"
                  f"  int8 speedup {row['speedup']:.2f}x")
    return rows


def bench_decode(rounds: int, prompt_len: int, max_tokens: int) -> dict:
    model_dir = str(ensure_default_model("llama", "medium"))
    common = dict(dtype="bfloat16", max_model_len=1024, num_kv_blocks=80, enable_prefix_caching=False)
    engines = {"bf16": LLM(model_dir, **common), "int8": LLM(model_dir, quantization="int8", **common)}
    prompt = {"prompt_token_ids": list(range(100, 100 + prompt_len))}
    full = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times: dict[str, dict[str, list[float]]] = {name: {"full": [], "first": []} for name in engines}
    for llm in engines.values():  # warm up
        llm.generate(prompt, full)
    for _ in range(rounds):
        for name, llm in engines.items():
            for kind, params in (("first", first), ("full", full)):
                start = time.perf_counter()
                out = llm.generate(prompt, params)
                times[name][kind].append(time.perf_counter() - start)
                assert len(out[0].outputs[0].token_ids) == params.max_tokens
    result = {}
    for name, t in times.items():
        decode_s = statistics.median(t["full"]) - statistics.median(t["first"])
        result[name] = {"decode_tok_s": (max_tokens - 1) / decode_s, "request_s": statistics.median(t["full"]),
                        "first_token_s": statistics.median(t["first"])}
        print(f"{name:>5}: decode {result[name]['decode_tok_s']:.1f} tok/s (median of {rounds}; request "
              f"{result[name]['request_s']:.2f} s, first token {result[name]['first_token_s']:.3f} s)")
    result["int8_speedup"] = result["int8"]["decode_tok_s"] / result["bf16"]["decode_tok_s"]
    print(f"int8 / bf16 decode: {result['int8_speedup']:.2f}x")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("linear", "decode", "all"), default="all")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=50, help="linear: calls per timing")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    report: dict = {"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__}
    if args.part in ("linear", "all"):
        report["linear"] = bench_linear(args.rounds, args.reps)
    if args.part in ("decode", "all"):
        report["decode"] = bench_decode(args.rounds, args.prompt_len, args.max_tokens)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
