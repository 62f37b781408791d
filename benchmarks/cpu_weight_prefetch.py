"""How far ahead the CPU linear kernels should prefetch their weights (WEIGHT_PREFETCH_BYTES in csrc/bf16.h).

Builds the bf16 and int8 kernels once per distance (0 = no software prefetch), and per setting of the bf16
kernel's one-row prefetch with --one-row-prefetch (BF16_ONE_ROW_PREFETCH; by default this CPU's choice,
cpu_linear.TUNING) and weight rows per tile with --tile-cols (BF16_TILE_COLS), and runs the 96 projection
matrices of the built-in `medium` Llama (24 layers x qkv 2048x1024, o 1024x1024, gate_up 5632x1024, down
1024x2816; random weights, more than the caches hold) for M rows of bf16 activations, the variants alternating
in each round. Reports the fastest pass of each as wall time and the weight bytes it streamed per second. The
weights sit on transparent huge pages as the engine's do (model/huge_pages.py; --no-huge-pages: where torch
put them).

    python benchmarks/cpu_weight_prefetch.py --threads 2 --rows 1,4 --distances 0,1024,2048,4096 --rounds 6
    python benchmarks/cpu_weight_prefetch.py --rows 1 --distances 4096 --one-row-prefetch 0,1 --rounds 10
    python benchmarks/cpu_weight_prefetch.py --rows 8,12,16,24 --distances 4096 --tile-cols 1,2 --rounds 10
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from pathlib import Path

import torch
from torch import nn

from llmserve.model import cpu_linear, huge_pages

SHAPES = [(2048, 1024), (1024, 1024), (5632, 1024), (1024, 2816)]  # (N, K) of medium's projections
LAYERS = 24


def build(kind: str, distance: int, extra: tuple[str, ...]) -> ctypes.CDLL:
    define = (f"WEIGHT_PREFETCH_BYTES={distance}", *extra)
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


def on_huge_pages(bf16_weights: list[torch.Tensor], int8_weights: list[tuple[torch.Tensor, torch.Tensor]]):
    """Moves the weights (in place of the lists' tensors) into one mapping on huge pages, as the runner moves a
    model's; returns the mapping (keep it alive), or None where the kernel does not advise huge pages."""
    holder = nn.Module()
    holder.bf16 = nn.ParameterList(nn.Parameter(w, requires_grad=False) for w in bf16_weights)
    holder.int8 = nn.ParameterList(nn.Parameter(q, requires_grad=False) for q, _ in int8_weights)
    arena = huge_pages.move_parameters(holder)
    bf16_weights[:] = [p.data for p in holder.bf16]
    int8_weights[:] = [(p.data, scale) for p, (_, scale) in zip(holder.int8, int8_weights, strict=True)]
    return arena


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None, help="OpenMP threads per call (default: torch's)")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--distances", default="0,1024,2048,4096", help="prefetch distances in bytes (0: none)")
    ap.add_argument("--one-row-prefetch", default="", help="BF16_ONE_ROW_PREFETCH values to build, e.g. 0,1 "
                    "(default: this CPU's tuning only)")
    ap.add_argument("--tile-cols", default="", help="BF16_TILE_COLS values to build, e.g. 1,2 (default: the source's)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--path", choices=sorted(cpu_linear.PATHS), default="best",
                    help="the kernels' implementation (e.g. avx2 on an AVX-512 machine)")
    ap.add_argument("--no-huge-pages", action="store_true", help="leave the weights on the pages torch gave them")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    threads = args.threads or torch.get_num_threads()
    distances = [int(d) for d in args.distances.split(",")]
    gen = torch.Generator().manual_seed(0)
    shapes = SHAPES * LAYERS
    bf16_weights = [torch.randn(shape, generator=gen).to(torch.bfloat16) for shape in shapes]
    int8_weights = [(torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8), torch.rand(shape[0]))
                    for shape in shapes]
    arena = None if args.no_huge_pages else on_huge_pages(bf16_weights, int8_weights)
    print(f"weights on huge pages: {'yes' if arena is not None else 'no'}")
    bytes_per_pass = {"bf16": sum(w.numel() * 2 for w in bf16_weights), "int8": sum(q.numel() for q, _ in int8_weights)}
    one_rows = [f"BF16_ONE_ROW_PREFETCH={v}" for v in args.one_row_prefetch.split(",") if v] or [""]
    tile_cols = [f"BF16_TILE_COLS={v}" for v in args.tile_cols.split(",") if v] or [""]
    bf16_extras = [tuple(d for d in (a, b) if d) for a in one_rows for b in tile_cols]
    libs = {(kind, d, extra): build(kind, d, extra)
            for kind in ("bf16", "int8") for d in distances for extra in (bf16_extras if kind == "bf16" else [()])}
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for k in {k for _, k in SHAPES}}
        best = {key: float("inf") for key in libs}
        for _ in range(args.rounds):
            for (kind, d, extra), lib in libs.items():
                start = time.perf_counter()
                if kind == "bf16":
                    bf16_pass(lib, xs, bf16_weights, threads, cpu_linear.PATHS[args.path])
                else:
                    int8_pass(lib, xs, int8_weights, threads, cpu_linear.PATHS[args.path])
                best[(kind, d, extra)] = min(best[(kind, d, extra)], time.perf_counter() - start)
        for (kind, d, extra), seconds in best.items():
            gbs = bytes_per_pass[kind] / seconds / 1e9
            results.append({"kind": kind, "rows": rows, "distance": d, "defines": list(extra),
                            "ms": seconds * 1e3, "weight_gbs": gbs})
            label = "".join(f" {define}" for define in extra)
            print(f"{kind} M={rows} prefetch {d:>5} B{label}: {seconds * 1e3:6.1f} ms  {gbs:5.1f} GB/s", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"threads": threads, "path": args.path, "results": results}, indent=2))


if __name__ == "__main__":
    main()
