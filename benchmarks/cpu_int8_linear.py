"""The CPU int8 linear kernel against the other ways to run an int8 (or bf16) linear, on the 96 projection
matrices of the built-in `medium` Llama (24 layers x qkv 2048x1024, o 1024x1024, gate_up 5632x1024, down
1024x2816; random weights, 283 MB in int8), for M rows of bf16 activations:

  - int8_kernel: `cpu_linear.int8_linear` (csrc/linear_int8_cpu.c), what `--quantization int8` runs for
    up to `cpu_linear.int8_max_rows()` rows; int8_portable: its plain-C implementation (--portable);
  - int8pack_mm: `torch._weight_int8pack_mm` (the int8 path before the kernel, scales in bf16);
  - convert: int8 weights converted to bf16, `F.linear`, scales on the output (int8 above int8_max_rows() rows);
  - bf16: `cpu_linear.linear` on the bf16 weights (the bf16 kernel up to `cpu_linear.max_rows()` rows, `F.linear` above);
    bf16_onednn: `F.linear` on them at every M (oneDNN), which the bf16 kernel replaces up to max_rows();
    bf16_onednn_packed (--packed): oneDNN on a copy of them pre-packed for each M.

Each pass runs all 96 matrices (more than the caches hold, so weights come from memory, as in a decode
step); the methods alternate, ROUNDS times, and the fastest pass of each is reported as process CPU time
(robust to busy neighbours; with --threads 1 it is the compute thread's time) and int8 weight GB/s
(283 MB / time: for bf16, half the bytes it actually reads). Then, per shape, the relative error
(Frobenius) of the int8 kernel's and `_weight_int8pack_mm`'s outputs against float64 x @ (q * scale)^T,
next to that of the float64 result rounded to bf16 (the least any bf16 output can have).

    python benchmarks/cpu_int8_linear.py --threads 1 --rows 1,2,4,8,16,64 --json bench_out/cpu_int8_linear.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from llmserve.model import cpu_linear
from llmserve.model.quantization.int8 import quantize_int8

SHAPES = [(2048, 1024), (1024, 1024), (5632, 1024), (1024, 2816)]  # (N, K) of medium's projections
LAYERS = 24


PACKED: dict[int, torch.Tensor] = {}  # id(bf16 weight) -> oneDNN's pre-packed copy for the current M (--packed)


def methods(portable: bool, packed: bool = False) -> dict[str, Callable]:
    found = {
        "int8_kernel": lambda x, w, q, s, s16: cpu_linear.int8_linear(x, q, s),
        "int8pack_mm": lambda x, w, q, s, s16: torch._weight_int8pack_mm(x, q, s16),
        "convert": lambda x, w, q, s, s16: F.linear(x, q.to(torch.bfloat16)) * s16,
        "bf16": lambda x, w, q, s, s16: cpu_linear.linear(x, w),
        "bf16_onednn": lambda x, w, q, s, s16: F.linear(x, w),
    }
    if packed:
        found["bf16_onednn_packed"] = lambda x, w, q, s, s16: torch.ops.mkldnn._linear_pointwise(
            x, PACKED[id(w)], None, "none", [], ""
        )
    if portable:
        found["int8_portable"] = lambda x, w, q, s, s16: cpu_linear.int8_linear(x, q, s, path="portable")
    return found


def _relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got.double() - exact).norm() / exact.norm()).item()


def accuracy(rows: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    found = []
    for n, k in SHAPES:
        q, scale = quantize_int8(torch.randn(n, k, generator=gen) * 0.02)
        x = torch.randn(rows, k, generator=gen).bfloat16()
        exact = x.double() @ (q.double() * scale.double()[:, None]).T
        row = {"n": n, "k": k, "rows": rows, "int8_kernel": _relative_error(cpu_linear.int8_linear(x, q, scale), exact),
               "int8pack_mm": _relative_error(torch._weight_int8pack_mm(x, q, scale.bfloat16()), exact),
               "bf16_rounding": _relative_error(exact.bfloat16(), exact)}
        found.append(row)
        print(f"{n}x{k}, {rows} rows: relative error int8 kernel {row['int8_kernel']:.3g}, int8pack_mm "
              f"{row['int8pack_mm']:.3g}, exact rounded to bf16 {row['bf16_rounding']:.3g}")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,4,8,16,64", help="comma-separated M values")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--portable", action="store_true", help="also the kernel's plain-C implementation")
    ap.add_argument("--packed", action="store_true",
                    help="also F.linear's oneDNN on bf16 weights pre-packed for each M (mkldnn._reorder_linear_weight)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert cpu_linear.load_int8() is not None, "the int8 kernel could not be built"
    print(f"fast paths built: bf16 kernel {cpu_linear.fast_paths()}, int8 kernel {cpu_linear.int8_fast_paths()}")

    gen = torch.Generator().manual_seed(0)
    matrices = []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            w = (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
            q, scale = quantize_int8(w)
            matrices.append((w, q, scale, scale.bfloat16()))
    int8_bytes = sum(q.numel() for _, q, _, _ in matrices)
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in {k for _, k in SHAPES}}
        if args.packed:
            PACKED.clear()
            PACKED.update({id(w): torch.ops.mkldnn._reorder_linear_weight(w, rows) for w, _, _, _ in matrices})
        best: dict[str, float] = {}
        for _ in range(args.rounds):
            for name, fn in methods(args.portable, args.packed).items():
                start = time.process_time()
                for w, q, scale, scale16 in matrices:
                    fn(xs[q.shape[1]], w, q, scale, scale16)
                best[name] = min(best.get(name, float("inf")), time.process_time() - start)
        row = {"rows": rows, **{f"{name}_ms": 1e3 * t for name, t in best.items()},
               **{f"{name}_gbs": int8_bytes / t / 1e9 for name, t in best.items()}}
        results.append(row)
        print(f"M={rows}: " + "  ".join(f"{name} {1e3 * t:.1f} ms ({int8_bytes / t / 1e9:.1f} GB/s)"
                                        for name, t in best.items()), flush=True)
    errors = accuracy(4)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "int8_bytes": int8_bytes, "results": results,
                                               "accuracy": errors}, indent=2))


if __name__ == "__main__":
    main()
