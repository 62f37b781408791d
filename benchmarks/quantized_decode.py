"""CPU batch-1 decode with int8 weights against bf16, on the built-in `medium` model, in one run.

1. Linear layers: `torch._weight_int8pack_mm` (the int8 kernel `--quantization int8` runs on CPU for up
   to 8 rows) and the conversion path it takes for more rows (int8 weights converted to bf16, then
   `F.linear`, scales on the output), against bf16 `F.linear`, at M = 1 to 256 rows for each of the
   medium model's projection shapes; they alternate, ROUNDS times, and the fastest of each is reported.
2. The offline engine: `LLM(medium, dtype=bfloat16)` and `LLM(..., quantization="int8")`, both loaded,
   the int8 one run twice, with our int8 kernel (`cpu_linear.int8_linear`) and with torch's
   `_weight_int8pack_mm` as before it; one request at a time (batch 1: a PROMPT-token prompt, MAX_TOKENS
   greedy tokens, ignore_eos), alternating, ROUNDS times. Decode tok/s = (MAX_TOKENS - 1) / (time of the
   request minus the time of a 1-token request with the same prompt, both medians): prefill excluded.
   llama.cpp Q8_0 (`llama-bench`, the GGUF of benchmarks/llama_cpp.sh) decodes the same workload in each
   round, its CPU time taken the same way (a 1-token run subtracted; skipped when not built).
   Times are process CPU time (what the work costs, robust to other processes on a shared machine) and
   wall-clock time; --threads sets torch's threads (1 makes CPU time the time of the one compute thread).

    python benchmarks/quantized_decode.py --json bench_out/quantized_decode.json
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
from batch1_decode import BENCH_CACHE, llama_bench_binary

from llmserve import LLM, SamplingParams
from llmserve.model import cpu_linear
from llmserve.model.builtin import ensure_default_model
from llmserve.model.quantization.int8 import quantize_int8

# (out, in) of the medium model's linear layers
MEDIUM_SHAPES = {"qkv_proj": (2048, 1024), "o_proj": (1024, 1024), "gate_up_proj": (5632, 1024),
                 "down_proj": (1024, 2816)}


def _time(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per call."""
    fn()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.process_time() - cpu) / reps, (time.perf_counter() - wall) / reps


def bench_linear(rounds: int, reps: int) -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, (n, k) in MEDIUM_SHAPES.items():
        weight = (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
        q, scale = quantize_int8(weight)
        scale = scale.bfloat16()
        for m in (1, 2, 4, 8, 16, 64, 256):
            x = torch.randn(m, k, generator=gen).bfloat16()
            kernels = {
                "bf16": lambda: torch.nn.functional.linear(x, weight),  # noqa: B023
                "int8": lambda: torch._weight_int8pack_mm(x, q, scale),  # noqa: B023
                "convert": lambda: torch.nn.functional.linear(x, q.to(torch.bfloat16)) * scale,  # noqa: B023
            }
            timings: dict[str, list[tuple[float, float]]] = {kernel: [] for kernel in kernels}
            for _ in range(rounds):
                for kernel, fn in kernels.items():
                    timings[kernel].append(_time(fn, max(1, reps * 8 // (m + 7))))
            row = {"layer": name, "n": n, "k": k, "m": m}
            for kernel, times in timings.items():
                row[f"{kernel}_cpu_us"] = 1e6 * min(t[0] for t in times)
                row[f"{kernel}_wall_us"] = 1e6 * min(t[1] for t in times)
            row["int8_speedup_cpu"] = row["bf16_cpu_us"] / row["int8_cpu_us"]
            rows.append(row)
            print(f"{name:>13} N={n:<5} K={k:<5} M={m:<3}: CPU time bf16 {row['bf16_cpu_us']:8.1f} us, int8 kernel "
                  f"{row['int8_cpu_us']:8.1f} us ({row['int8_speedup_cpu']:.2f}x), convert {row['convert_cpu_us']:8.1f} us"
                  f"; wall bf16 {row['bf16_wall_us']:8.1f}, int8 {row['int8_wall_us']:8.1f}, convert "
                  f"{row['convert_wall_us']:8.1f} us")
    return rows


def llama_cpp_decode(gguf: Path, prompt_len: int, max_tokens: int) -> tuple[float, float]:
    """One llama.cpp (`llama-bench`) decode of the same workload: (CPU seconds of a run generating
    `max_tokens` tokens after a `prompt_len` context less those of a run generating 1, so that loading, the
    context's prefill and the warm-up cancel out; the tok/s llama-bench reports, by wall time)."""
    cpu = {}
    for n in (1, max_tokens):
        before = _children_cpu_s()
        out = subprocess.run([str(llama_bench_binary()), "-m", str(gguf), "-t", str(torch.get_num_threads()), "-p",
                              "0", "-n", str(n), "-d", str(prompt_len), "-r", "1", "-o", "json"],
                             check=True, capture_output=True, text=True).stdout
        cpu[n] = _children_cpu_s() - before
    return cpu[max_tokens] - cpu[1], float(json.loads(out)[0]["avg_ts"])


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def bench_decode(rounds: int, prompt_len: int, max_tokens: int) -> dict:
    model_dir = str(ensure_default_model("llama", "medium"))
    common = dict(dtype="bfloat16", max_model_len=1024, num_kv_blocks=80, enable_prefix_caching=False)
    bf16, int8 = LLM(model_dir, **common), LLM(model_dir, quantization="int8", **common)
    # (engine, whether --quantization int8 takes the C kernel or torch's _weight_int8pack_mm, as before it)
    variants = {"bf16": (bf16, True), "int8": (int8, True), "int8_torch_kernel": (int8, False)}
    prompt = {"prompt_token_ids": list(range(100, 100 + prompt_len))}
    full = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times: dict[str, dict[str, list[tuple[float, float]]]] = {name: {"full": [], "first": []} for name in variants}
    gguf = BENCH_CACHE / "gguf" / f"{Path(model_dir).name}-q8_0.gguf"
    llama_cpp: list[tuple[float, float]] | None = [] if llama_bench_binary() is not None and gguf.exists() else None
    if llama_cpp is None:
        print("llama.cpp Q8_0: llama-bench or the GGUF file missing, see benchmarks/llama_cpp.sh (skipped)")
    for llm in (bf16, int8):  # warm up
        llm.generate(prompt, full)
    for _ in range(rounds):
        for name, (llm, int8_kernel) in variants.items():
            cpu_linear.use_int8_kernel(int8_kernel)
            for kind, params in (("first", first), ("full", full)):
                cpu, wall = time.process_time(), time.perf_counter()
                out = llm.generate(prompt, params)
                times[name][kind].append((time.process_time() - cpu, time.perf_counter() - wall))
                assert len(out[0].outputs[0].token_ids) == params.max_tokens
        if llama_cpp is not None:
            llama_cpp.append(llama_cpp_decode(gguf, prompt_len, max_tokens))
    cpu_linear.use_int8_kernel(True)
    result: dict = {"rounds": {name: t for name, t in times.items()}}
    for name, t in times.items():
        result[name] = {}
        for clock, i in (("cpu", 0), ("wall", 1)):
            full_s = statistics.median(x[i] for x in t["full"])
            first_s = statistics.median(x[i] for x in t["first"])
            result[name][f"decode_tok_s_{clock}"] = (max_tokens - 1) / (full_s - first_s)
    if llama_cpp is not None:
        result["rounds"]["llama_cpp_q8_0"] = llama_cpp
        result["llama_cpp_q8_0"] = {"decode_tok_s_cpu": (max_tokens - 1) / statistics.median(c for c, _ in llama_cpp),
                                    "decode_tok_s_wall": statistics.median(w for _, w in llama_cpp)}
    for name in [*variants, "llama_cpp_q8_0"]:
        if name in result:
            print(f"{name:>17}: decode {result[name]['decode_tok_s_cpu']:.1f} tok/s by CPU time, "
                  f"{result[name]['decode_tok_s_wall']:.1f} tok/s by wall time (medians of {rounds})")
    for clock in ("cpu", "wall"):
        key = f"decode_tok_s_{clock}"
        result[f"int8_speedup_{clock}"] = result["int8"][key] / result["bf16"][key]
        result[f"int8_vs_torch_kernel_{clock}"] = result["int8"][key] / result["int8_torch_kernel"][key]
        if "llama_cpp_q8_0" in result:
            result[f"int8_vs_llama_cpp_q8_0_{clock}"] = result["int8"][key] / result["llama_cpp_q8_0"][key]
    print(f"int8 / bf16 decode: {result['int8_speedup_cpu']:.2f}x (CPU time), {result['int8_speedup_wall']:.2f}x (wall); "
          f"int8 kernel / torch's int8 kernel: {result['int8_vs_torch_kernel_cpu']:.2f}x (CPU time)"
          + (f"; int8 / llama.cpp Q8_0: {result['int8_vs_llama_cpp_q8_0_cpu']:.2f}x (CPU time), "
             f"{result['int8_vs_llama_cpp_q8_0_wall']:.2f}x (wall)" if "llama_cpp_q8_0" in result else ""))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("linear", "decode", "all"), default="all")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=50, help="linear: calls per timing")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
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
