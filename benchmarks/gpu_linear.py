"""The linear layers of a batch-1 (to 16-row) decode step on the Llama-3.1-8B shape: each kernel's time
and the weight bytes it streams per second, against the device's copy bandwidth measured in the same run.

Kernels, for M = 1, 2, 4, 8, 16 rows of bf16 activations:
  - bf16 weights: `F.linear` (cuBLAS) and `triton_linear` (the product's tiles for the shape, then its
    kind's one tile and a sweep of tiles);
  - int8 weights (per-channel scales): the Triton matmul `triton_int8.w8a16_matmul` and `triton_linear`;
  - fp8 e4m3 weights (per-channel scales): `_scaled_mm` with per-token e4m3 activations (the W8A8 path,
    its quantization included) and `triton_linear` (weight-only).
Each time is one call's share of a CUDA graph of REPS calls that rotate over enough copies of the weight
that they never sit in L2 (the median of several replays), so launch gaps and cache hits stay out of it.
The sweep's best tiles per (weight width, one row or more) are picked by the time of a whole decode
step's linears (32 x (qkv + o + gate_up + down) + lm_head) and printed as `triton_linear._CONFIGS` rows;
at one row, each shape whose best tile is 5% faster than the product's is printed as a `_SHAPE_CONFIGS` row.
The layers after an RMSNorm are also timed at one row with the norm folded into their launch, against the norm
kernel and then the projection.

    python benchmarks/gpu_linear.py --json bench_out/gpu/linear.json
    python benchmarks/gpu_linear.py --smoke     # CPU interpreter, tiny shapes: checks the script only
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import astuple
from typing import Any

import torch

SHAPES_8B = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
             "down_proj": (4096, 14336), "lm_head": (128256, 4096)}
PER_STEP = {"qkv_proj": 32, "o_proj": 32, "gate_up_proj": 32, "down_proj": 32, "lm_head": 1}
SMOKE_SHAPES = {"qkv_proj": (96, 64), "o_proj": (64, 64), "gate_up_proj": (256, 64), "down_proj": (64, 128),
                "lm_head": (500, 64)}

# TileConfig fields (block_n, block_k, warps[, stages, unroll, vector, split_k]) per weight width; the defaults in
# triton_linear._CONFIGS are always timed too. The 1-byte rows with vector 8 load slices ahead without a barrier
# in the loop: up to 2-3x the bytes in flight an SM holds with the default tiles (`benchmarks/gpu_sass.py`). The
# rows with split_k cut K into 2-4 runs: more, shorter programs, for the small layers (qkv_proj, o_proj), which
# lose 3-4 us each against their bytes at copy speed (BENCHMARKS.md, issue 18, ninth session).
ONE_ROW_SWEEP = {
    2: [(4, 1024, 4), (4, 2048, 4), (8, 512, 4), (8, 1024, 4), (8, 1024, 8), (8, 2048, 8), (16, 256, 4),
        (16, 512, 4), (16, 512, 8), (16, 1024, 8), (32, 256, 4), (32, 512, 8), (8, 1024, 4, 1, 2),
        (4, 2048, 4, 1, 1, 16, 2), (8, 1024, 4, 1, 1, 16, 2), (16, 512, 8, 1, 1, 16, 2), (8, 512, 4, 1, 1, 16, 4)],
    1: [(4, 1024, 4), (4, 2048, 4), (4, 4096, 4), (8, 1024, 4), (8, 2048, 4), (16, 1024, 4), (16, 512, 8),
        (16, 256, 4), (8, 1024, 4, 1, 1, 8), (8, 1024, 4, 1, 2, 8), (4, 1024, 4, 1, 2, 8), (4, 1024, 4, 1, 4, 8),
        (4, 2048, 4, 1, 1, 8), (4, 2048, 8, 1, 2, 8), (2, 2048, 4, 1, 4, 8), (2, 1024, 4, 1, 8, 8),
        (8, 1024, 4, 1, 1, 16, 2), (16, 512, 8, 1, 1, 16, 2), (16, 1024, 8, 1, 1, 16, 2), (8, 1024, 4, 1, 1, 16, 4),
        (16, 512, 4, 1, 1, 16, 4)],
}
# The layers that follow an RMSNorm -> whether SiLU-and-multiply runs in their launch. At one row each is also
# timed with the norm folded into its launch (`triton_linear.normed_linear`) against the norm kernel, then the
# projection: for the product's tiles and these, which give fewer programs (every program reads the row for
# its own mean square, so fewer programs read less of it from L2).
NORM_FOLDED = {"qkv_proj": False, "gate_up_proj": True}
NORM_FOLD_SWEEP = [(16, 512, 8), (32, 256, 4), (32, 512, 8), (64, 256, 8)]
MANY_ROW_SWEEP = {
    2: [(16, 64, 4, 3), (16, 128, 4, 3), (16, 256, 4, 2), (32, 64, 4, 3), (32, 128, 4, 4)],
    1: [(32, 128, 4, 4), (16, 256, 4, 4), (32, 256, 4, 4), (64, 128, 4, 4), (32, 128, 4, 6), (16, 512, 4, 3)],
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=20, help="calls per captured graph")
    ap.add_argument("--no-sweep", action="store_true", help="only the default tiles")
    ap.add_argument("--weights", default="bf16,int8,fp8", help="which weight kinds to time")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, os.path.dirname(__file__))
    from gpu_common import GB, bench_device, copy_bandwidth_gbs, machine_info, print_table, write_json

    from llmserve.model import triton_linear
    from llmserve.model.quantization import fp8, int8, triton_int8

    device = bench_device(args.smoke)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES_8B
    rows_list = [int(r) for r in args.rows.split(",")]
    dtype = torch.float32 if args.smoke else torch.bfloat16
    copy_gbs = copy_bandwidth_gbs(device, 1 << (26 if args.smoke else 32))
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s", flush=True)
    timer = GraphTimer(device, 2 if args.smoke else args.reps)
    wanted = args.weights.split(",")
    results: list[dict[str, Any]] = []
    norm_fold: list[dict[str, Any]] = []
    gen = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in shapes.items():
        full = torch.randn(n, k, device=device, generator=gen, dtype=torch.float32).mul_(0.02)
        weights = {"bf16": (full.to(dtype), None), "int8": int8.quantize_int8(full),
                   "fp8": fp8.quantize_fp8(full)}
        weights = {kind: weights[kind] for kind in wanted}
        del full
        for wname, (w, scale) in weights.items():
            copies = max(2, math.ceil((256 << 20) / (w.numel() * w.element_size())))
            ws = [w] + [w.clone() for _ in range(copies - 1)]
            for m in rows_list:
                x = torch.randn(m, k, device=device, generator=gen).to(dtype)
                reference = (x.double() @ (w.double() * (1 if scale is None else scale.double()[:, None])).T)
                kernels = library_kernels(wname, ws, scale, x, args.smoke, fp8, triton_int8)
                sweep = [] if args.no_sweep else (ONE_ROW_SWEEP if m == 1 else MANY_ROW_SWEEP)[min(w.element_size(), 2)]
                sweep = sweep[:2] if args.smoke else sweep
                # "triton_linear": the product's tiles for this shape; then its kind's tiles and the sweep's, by name
                default = triton_linear.config_for(w, m)
                kind_default = triton_linear._CONFIGS[(triton_linear.weight_kind(w), m == 1)]
                configs = [None, *dict.fromkeys([kind_default, *(triton_linear.TileConfig(*c) for c in sweep)])]
                for config in configs:
                    label = "triton_linear" if config is None else f"triton_linear {config_label(config)}"
                    kernels[label] = rotating(ws, lambda w_, c=config, x=x, s=scale: triton_linear.linear(x, w_, s, None, c))
                for label, fn in kernels.items():
                    try:  # a tile this Triton cannot build is reported and skipped, not the end of the sweep
                        err = (fn(0).double() - reference).norm().item() / reference.norm().item()
                    except Exception as e:  # noqa: BLE001
                        print(f"  FAILED: {name} {wname} M={m} {label}: {type(e).__name__}: {e}"[:400], flush=True)
                        continue
                    if not err < 2e-2:
                        print(f"  WRONG: {name} {wname} M={m} {label}: relative error {err:.3g}", flush=True)
                    us = timer.time_us(fn, len(ws))
                    nbytes = w.numel() * w.element_size()
                    results.append({"layer": name, "n": n, "k": k, "weights": wname, "rows": m, "kernel": label,
                                    "tiles": (list(astuple(default)) if label == "triton_linear" else
                                              list(parse_config(label)) if label.startswith("triton_linear") else None),
                                    "us": us, "gbs": nbytes / us / 1e3, "pct_copy": 100 * nbytes / us / 1e3 / copy_gbs,
                                    "rel_err": err})
                if m == 1 and name in NORM_FOLDED:
                    fold_configs = [None] + ([] if args.no_sweep else NORM_FOLD_SWEEP[: 1 if args.smoke else None])
                    norm_fold += time_norm_fold(name, wname, ws, scale, x, timer, fold_configs)
                best = min((r for r in results if r["layer"] == name and r["weights"] == wname and r["rows"] == m),
                           key=lambda r: r["us"])
                print(f"{name:>13} {wname:>5} M={m:<2}: best {best['kernel']} {best['us']:.1f} us "
                      f"({best['pct_copy']:.0f}% of copy)", flush=True)
            del ws
        torch.cuda.empty_cache() if device.type == "cuda" else None
    summary = summarize(results, rows_list)
    best = best_configs(summary, results)
    by_shape = best_shape_configs(results)
    out = {"machine": machine_info(device), "copy_gbs": copy_gbs, "reps": timer.reps, "results": results,
           "summary": summary, "best_configs": best, "best_shape_configs": by_shape, "norm_fold": norm_fold}
    print_summary(summary, copy_gbs, print_table, GB)
    if norm_fold:
        print_table("One row after an add + RMSNorm: the norm kernel, then the projection, against the norm folded "
                    "into the projection's launch (us a call)", ["layer", "weights", "tiles", "norm kernel + projection",
                                                                  "norm folded in", "saved"],
                    [[r["layer"], r["weights"], r["tiles"], f"{r['two_launches_us']:.1f}", f"{r['folded_us']:.1f}",
                      f"{r['two_launches_us'] - r['folded_us']:.1f}"] for r in norm_fold])
    print("\nbest tiles by a decode step's linears (weight kind, one row):")
    for key, config in best.items():
        print(f"  {key}: TileConfig{tuple(config)}")
    print("\none-row shapes with tiles at least 5% faster than the product's (triton_linear._SHAPE_CONFIGS):")
    for key, (config, us, product_us) in by_shape.items():
        print(f"  {key}: TileConfig{tuple(config)}  {us:.1f} us against {product_us:.1f}")
    write_json(args.json, out)
    return out


def config_label(c) -> str:
    return f"n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages} u{c.unroll} v{c.vector} x{c.split_k}"


def rotating(ws: list[torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[int], torch.Tensor]:
    return lambda i: fn(ws[i % len(ws)])


def time_norm_fold(layer, wname, ws, scale, x, timer, configs) -> list[dict[str, Any]]:
    """One row x after an add + RMSNorm: the norm kernel, then the projection (two launches), against the norm
    folded into the projection's launch, for each of `configs` (None: the product's tiles)."""
    from llmserve.model import fused_kernels, triton_linear

    swiglu = NORM_FOLDED[layer]
    residual, norm_w = torch.randn_like(x), torch.rand(x.shape[1], device=x.device).add_(0.5).to(x.dtype)
    norm = triton_linear.FoldedNorm(norm_w, 1e-5, residual)
    rows = []
    for tiles in configs:
        config = None if tiles is None else triton_linear.TileConfig(*tiles)

        def two_launches(w, c=config):
            normed, _ = fused_kernels.fused_add_rms_norm(x, residual, norm_w, 1e-5)
            return triton_linear.linear(normed, w, scale, None, c, swiglu=swiglu)

        def folded(w, c=config):
            return triton_linear.normed_linear(x, norm, w, scale, None, c, swiglu=swiglu)[0]

        times = {label: timer.time_us(rotating(ws, fn), len(ws)) for label, fn in
                 (("two_launches_us", two_launches), ("folded_us", folded))}
        label = "the product's" if config is None else config_label(config)
        rows.append({"layer": layer, "weights": wname, "tiles": label, **times})
        print(f"  {layer} {wname} M=1 {label}: norm + projection {times['two_launches_us']:.1f} us, folded "
              f"{times['folded_us']:.1f} us", flush=True)
    return rows


def library_kernels(wname, ws, scale, x, smoke, fp8, triton_int8) -> dict[str, Callable[[int], torch.Tensor]]:
    if wname == "bf16":
        return {"F.linear": rotating(ws, lambda w: torch.nn.functional.linear(x, w))}
    if wname == "int8":
        return {"w8a16_matmul": rotating(ws, lambda w: triton_int8.w8a16_matmul(x, w, scale, None))}
    if smoke or not fp8.scaled_mm_supported(x.device):
        return {}
    row_scale = scale.reshape(1, -1).float()
    return {"_scaled_mm (W8A8)": rotating(ws, lambda w: fp8._scaled_mm(x, w, row_scale, None))}


class GraphTimer:
    """One call's time: a CUDA graph of `reps` calls (rotating over weight copies), replayed; on CPU a loop."""

    def __init__(self, device: torch.device, reps: int) -> None:
        self.device, self.reps = device, reps

    def time_us(self, fn: Callable[[int], torch.Tensor], copies: int) -> float:
        calls = [lambda i=i: fn(i % copies) for i in range(self.reps)]
        if self.device.type != "cuda":
            import time

            start = time.perf_counter()
            for call in calls:
                call()
            return (time.perf_counter() - start) / self.reps * 1e6
        for call in calls[:copies]:
            call()  # compile and warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        graph.replay()
        times = []
        for _ in range(7):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / self.reps)
        del graph
        return statistics.median(times)


def summarize(results: list[dict[str, Any]], rows_list: list[int]) -> dict[str, Any]:
    """Per (weights, rows): each kernel's decode-step total (PER_STEP-weighted), the best kernel per layer,
    and the best sweep tile by that total."""
    summary: dict[str, Any] = {}
    for wname in ("bf16", "int8", "fp8"):
        for m in rows_list:
            rs = [r for r in results if r["weights"] == wname and r["rows"] == m]
            if not rs:
                continue
            totals: dict[str, float] = {}
            for kernel in {r["kernel"] for r in rs}:
                mine = {r["layer"]: r["us"] for r in rs if r["kernel"] == kernel}
                if set(mine) == set(PER_STEP):
                    totals[kernel] = sum(PER_STEP[layer] * us for layer, us in mine.items())
            nbytes = sum(PER_STEP[r["layer"]] * r["n"] * r["k"] for r in rs if r["kernel"] == rs[0]["kernel"])
            nbytes *= 2 if wname == "bf16" else 1
            summary[f"{wname} M={m}"] = {
                "step_us": dict(sorted(totals.items(), key=lambda kv: kv[1])),
                "step_bytes": nbytes,
                "best_per_layer": {layer: min((r for r in rs if r["layer"] == layer), key=lambda r: r["us"])["kernel"]
                                   for layer in PER_STEP if any(r["layer"] == layer for r in rs)},
            }
    return summary


def best_configs(summary: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, list[int]]:
    """For each (weight kind, one row or more) measured, as "kind,one_row": the tiles with the least
    decode-step time, summed for the many-row kernel over every M > 1 measured."""
    tiles = {(r["weights"], r["rows"], r["kernel"]): tuple(r["tiles"]) for r in results if r["tiles"]}
    best: dict[str, list[int]] = {}
    for one_row in (True, False):
        for wname in ("bf16", "int8", "fp8"):
            totals: dict[tuple[int, ...], float] = {}
            for key, s in summary.items():
                kind, m = key.split(" M=")
                if kind != wname or (int(m) == 1) != one_row:
                    continue
                for kernel, us in s["step_us"].items():
                    if not kernel.startswith("triton_linear "):
                        continue  # one tile for every layer: not the library kernels, nor the product's per-shape mix
                    config = tiles[(wname, int(m), kernel)]
                    totals[config] = totals.get(config, 0.0) + us
            if totals:
                best[f"{KIND[wname]},{int(one_row)}"] = list(min(totals, key=totals.__getitem__))
    return best


KIND = {"bf16": "16-bit", "int8": "int8", "fp8": "fp8"}  # gpu_linear's weight names -> triton_linear.weight_kind


def best_shape_configs(results: list[dict[str, Any]], margin: float = 0.95) -> dict[str, tuple[list[int], float, float]]:
    """One row: for each (kind, N, K) whose best swept tile takes under `margin` of the product's own tiles'
    time, "kind,N,K" -> (those tiles, their us, the product's us)."""
    best: dict[str, tuple[list[int], float, float]] = {}
    for r in results:
        if r["rows"] != 1 or not r["tiles"]:
            continue
        key = f"{KIND[r['weights']]},{r['n']},{r['k']}"
        product = next(p for p in results if p["rows"] == 1 and p["weights"] == r["weights"] and p["layer"] == r["layer"]
                       and p["kernel"] == "triton_linear")
        if r["us"] < margin * product["us"] and r["us"] < best.get(key, (None, float("inf")))[1]:
            best[key] = (r["tiles"], r["us"], product["us"])
    return best


def parse_config(label: str) -> tuple[int, ...]:
    """"triton_linear n8 k512 w4 s1 u1 v16 x2" -> (8, 512, 4, 1, 1, 16, 2)."""
    return tuple(int(part[1:]) for part in label.split()[1:])


def print_summary(summary: dict[str, Any], copy_gbs: float, print_table, GB: float) -> None:
    rows = []
    for key, s in summary.items():
        ranked = list(s["step_us"].items())
        for kernel, us in ranked[:3] + [kv for kv in ranked[3:] if not kv[0].startswith("triton_linear n")]:
            rows.append([key, kernel, f"{us / 1e3:.3f}", f"{s['step_bytes'] / us / 1e3:.0f}",
                         f"{100 * s['step_bytes'] / us / 1e3 / copy_gbs:.1f}%"])
    print_table("The linears of one decode step (32 layers + lm_head), by kernel: ms, GB/s of weights, % of copy",
                ["weights, rows", "kernel", "ms", "GB/s", "% of copy"], rows)
    print("\nbest per layer:")
    for key, s in summary.items():
        print(f"  {key}: {s['best_per_layer']}")


if __name__ == "__main__":
    main()
