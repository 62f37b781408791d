"""How far ahead the CPU linear kernels should prefetch their weights (WEIGHT_PREFETCH_BYTES in csrc/bf16.h).

Builds the bf16 and int8 kernels once per distance (0 = no software prefetch) and runs the 96 projection
matrices of the built-in `medium` Llama (24 layers x qkv 2048x1024, o 1024x1024, gate_up 5632x1024, down
1024x2816; random weights, more than the caches hold) for M rows of bf16 activations, the variants alternating
in each round. Reports the fastest pass of each as wall time and the weight bytes it streamed per second.

    python benchmarks/cpu_weight_prefetch.py --threads 2 --rows 1,4 --distances 0,1024,2048,4096 --rounds 6
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from pathlib import Path

import torch

from llmserve.model import cpu_linear

SHAPES = [(2048, 1024), (1024, 1024), (5632, 1024), (1024, 2816)]  # (N, K) of medium's projections
LAYERS = 24


def build(kind: str, distance: int) -> ctypes.CDLL:
    define = (f"WEIGHT_PREFETCH_BYTES={distance}",)
    lib = cpu_linear.load(define) if kind == "bf16" else cpu_linear.load_int8(define)
    if lib is None:
        raise SystemExit("the kernels could not be built (no C compiler, or LLMSERVE_CPU_KERNELS=0)")
    return lib


def bf16_pass(lib: ctypes.CDLL, xs: dict[int, torch.Tensor], weights: list[torch.Tensor], threads: int,
              path: int) -> None:
    for w in weights:
        n, k = w.shape
        x = xs[k]
        y = torch.empty((x.shape[0], n), dtype=torch.bfloat16)
        lib.llmserve_linear_bf16(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(w.data_ptr()), None,
                                 ctypes.c_void_p(y.data_ptr()), x.shape[0], n, k, k, threads, path)


def int8_pass(lib: ctypes.CDLL, xs: dict[int, torch.Tensor], weights: list[tuple[torch.Tensor, torch.Tensor]],
              threads: int, path: int) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for q, scale in weights:
        n, k = q.shape
        x = xs[k]
        y = torch.empty((x.shape[0], n), dtype=torch.bfloat16)
        lib.llmserve_linear_int8(ptr(x.data_ptr()), i64(x.shape[0]), i64(k), i64(k), ptr(q.data_ptr()),
                                 ptr(scale.data_ptr()), None, i64(n), ptr(y.data_ptr()), threads, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="OpenMP threads per call (default: torch's)")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--distances", default="0,1024,2048,4096", help="prefetch distances in bytes (0: none)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--path", choices=sorted(cpu_linear.PATHS), default="best",
                    help="the kernels' implementation (e.g. avx2 on an AVX-512 machine)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    threads = args.threads or torch.get_num_threads()
    distances = [int(d) for d in args.distances.split(",")]
    gen = torch.Generator().manual_seed(0)
    shapes = SHAPES * LAYERS
    bf16_weights = [torch.randn(shape, generator=gen).to(torch.bfloat16) for shape in shapes]
    int8_weights = [(torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8), torch.rand(shape[0]))
                    for shape in shapes]
    bytes_per_pass = {"bf16": sum(w.numel() * 2 for w in bf16_weights), "int8": sum(q.numel() for q, _ in int8_weights)}
    libs = {(kind, d): build(kind, d) for kind in ("bf16", "int8") for d in distances}
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for k in {k for _, k in SHAPES}}
        best = {key: float("inf") for key in libs}
        for _ in range(args.rounds):
            for (kind, d), lib in libs.items():
                start = time.perf_counter()
                if kind == "bf16":
                    bf16_pass(lib, xs, bf16_weights, threads, cpu_linear.PATHS[args.path])
                else:
                    int8_pass(lib, xs, int8_weights, threads, cpu_linear.PATHS[args.path])
                best[(kind, d)] = min(best[(kind, d)], time.perf_counter() - start)
        for (kind, d), seconds in best.items():
            gbs = bytes_per_pass[kind] / seconds / 1e9
            results.append({"kind": kind, "rows": rows, "distance": d, "ms": seconds * 1e3, "weight_gbs": gbs})
            print(f"{kind} M={rows} prefetch {d:>5} B: {seconds * 1e3:6.1f} ms  {gbs:5.1f} GB/s", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"threads": threads, "path": args.path, "results": results}, indent=2))


if __name__ == "__main__":
    main()
