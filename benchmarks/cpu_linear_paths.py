"""The CPU linear kernels' implementations against each other and against torch, per number of rows of x.

Runs the 96 projection matrices of the built-in `medium` Llama (cpu_weight_prefetch.py's set, on huge pages
as the engine's are) for M rows of bf16 activations, on every fast path the kernels built on this CPU
(cpu_linear.FAST_PATHS: avx512_bf16, avx512, avx2), and through torch:
  - bf16: `F.linear` (oneDNN's bf16 GEMM where torch has one, else its generic loop) and
    `cpu_linear.float32_gemm`;
  - int8: `torch.ops.aten._weight_int8pack_mm` and `float32_gemm` on the int8 weights.
The variants alternate in each round; reports the fastest pass of each as wall time and weight GB/s. This is
how each path's row limit (cpu_linear.MAX_ROWS and friends) was chosen.

    python benchmarks/cpu_linear_paths.py --rows 1,2,4,8,12,16,24 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from cpu_weight_prefetch import LAYERS, SHAPES, bf16_pass, int8_pass, on_huge_pages

from llmserve.model import cpu_linear

Pass = Callable[[dict[int, torch.Tensor]], None]


def variants(bf16_weights: list[torch.Tensor], int8_weights: list[tuple[torch.Tensor, torch.Tensor]],
             threads: int) -> dict[tuple[str, str], Pass]:
    lib, lib8 = cpu_linear.load(), cpu_linear.load_int8()
    if lib is None or lib8 is None:
        raise SystemExit("the kernels could not be built (no C compiler, or LLMSERVE_CPU_KERNELS=0)")
    found: dict[tuple[str, str], Pass] = {}
    for path in cpu_linear.fast_paths():
        code = cpu_linear.PATHS[path]
        found[("bf16", path)] = lambda xs, code=code: bf16_pass(lib, xs, bf16_weights, threads, code)
    for path in cpu_linear.int8_fast_paths():
        code = cpu_linear.PATHS[path]
        found[("int8", path)] = lambda xs, code=code: int8_pass(lib8, xs, int8_weights, threads, code)
    found[("bf16", "F.linear")] = lambda xs: [F.linear(xs[w.shape[1]], w) for w in bf16_weights]
    found[("bf16", "float32_gemm")] = lambda xs: [cpu_linear.float32_gemm(xs[w.shape[1]], w) for w in bf16_weights]
    found[("int8", "_weight_int8pack_mm")] = lambda xs: [
        torch.ops.aten._weight_int8pack_mm(xs[q.shape[1]], q, s.to(torch.bfloat16)) for q, s in int8_weights]
    found[("int8", "float32_gemm")] = lambda xs: [
        cpu_linear.float32_gemm(xs[q.shape[1]], q, scale=s) for q, s in int8_weights]
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,12,16,24")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    shapes = SHAPES * LAYERS
    bf16_weights = [torch.randn(shape, generator=gen).to(torch.bfloat16) for shape in shapes]
    int8_weights = [(torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8), torch.rand(shape[0]))
                    for shape in shapes]
    arena = on_huge_pages(bf16_weights, int8_weights)  # noqa: F841 (keeps the mapping alive)
    bytes_per_pass = {"bf16": sum(w.numel() * 2 for w in bf16_weights), "int8": sum(q.numel() for q, _ in int8_weights)}
    passes = variants(bf16_weights, int8_weights, threads)
    print(f"threads {threads}; bf16 kernel paths {cpu_linear.fast_paths()}, int8 {cpu_linear.int8_fast_paths()}; "
          f"native bf16 GEMM in torch: {cpu_linear.native_bf16_gemm()}")
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for k in {k for _, k in SHAPES}}
        best = dict.fromkeys(passes, float("inf"))
        for _ in range(args.rounds):
            for key, run in passes.items():
                start = time.perf_counter()
                run(xs)
                best[key] = min(best[key], time.perf_counter() - start)
        for (kind, name), seconds in best.items():
            gbs = bytes_per_pass[kind] / seconds / 1e9
            results.append({"kind": kind, "variant": name, "rows": rows, "ms": seconds * 1e3, "weight_gbs": gbs})
            print(f"{kind} M={rows:>2} {name:>20}: {seconds * 1e3:7.1f} ms  {gbs:5.1f} GB/s", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"threads": threads, "results": results}, indent=2))


if __name__ == "__main__":
    main()
