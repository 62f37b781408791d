"""Batch-1 decode on the Llama-3.1-8B shape (dummy weights): tokens/s and achieved HBM bandwidth
against the device's copy bandwidth measured in the same run, for bf16 weights and the variants named
by --variants (quantized weights, an fp8 KV cache, the linear layers' kernel path).

A decode step reads every weight once (the embedding table aside: its rows are gathered) and the KV
of the whole context, so  achieved bandwidth = (weight bytes + KV bytes read) / step time,  with the
step timed end to end around `engine.step()` (scheduling, input preparation, forward, sampling and the
read of the sampled id). Weight bytes are those of the loaded parameters (int8 / e4m3 weights count
one byte, their scales four per row). Copy bandwidth: a large device-to-device copy, 2 * bytes / time.
Goal (bf16): >= 85%. Each run also reports its KV pool in tokens at the default gpu_memory_utilization.
--profile adds the device time of every kernel of a step, grouped by kind (what is not weight streaming).

    python benchmarks/gpu_decode.py --json bench_out/gpu/decode.json
    python benchmarks/gpu_decode.py --variants bf16,fp8,int8,bf16-fp8kv --modes graphs --profile
    python benchmarks/gpu_decode.py --smoke        # CPU, tiny model: checks the script, not the GPU
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from gpu_common import (
    GB,
    bench_device,
    copy_bandwidth_gbs,
    engine_args,
    free_device_memory,
    machine_info,
    model_dir,
    print_table,
    random_prompts,
    write_json,
)

from llmserve import LLM, SamplingParams, pdl
from llmserve.model import layers
from llmserve.model.attention import triton_backend

GOAL_PCT_OF_COPY_BW = 85.0
# name -> (engine arguments, the CUDA linear path: layers.cuda_linear_path). Each runs with the Triton kernels
# launched as the product launches them; a name may end in any of SUFFIXES: "-nopdl" runs that variant without
# programmatic dependent launch (llmserve.pdl), "-foldnorms" with each decode row's RMSNorm run inside the next
# projection's launch (layers.fold_norms), "-foldrotary" with a decode step's rotary and KV write inside its
# attention launch (triton_backend.fold_rotary).
NO_PDL_SUFFIX = "-nopdl"
FOLD_NORMS_SUFFIX = "-foldnorms"
FOLD_ROTARY_SUFFIX = "-foldrotary"
SUFFIXES = (NO_PDL_SUFFIX, FOLD_NORMS_SUFFIX, FOLD_ROTARY_SUFFIX)
VARIANTS: dict[str, tuple[dict[str, Any], str]] = {
    "bf16": ({}, "auto"),
    "bf16-cublas": ({}, "torch"),
    "fp8": ({"quantization": "fp8"}, "auto"),
    "fp8-head": ({"quantization": "fp8", "quantize_lm_head": True}, "auto"),
    "fp8-scaled-mm": ({"quantization": "fp8"}, "torch"),
    "int8": ({"quantization": "int8"}, "auto"),
    "int8-head": ({"quantization": "int8", "quantize_lm_head": True}, "auto"),
    "int8-w8a16-matmul": ({"quantization": "int8"}, "torch"),
    "bf16-fp8kv": ({"kv_cache_dtype": "fp8"}, "auto"),
    "fp8-fp8kv": ({"quantization": "fp8", "kv_cache_dtype": "fp8"}, "auto"),
}


def split_variant(name: str) -> tuple[str, set[str]]:
    """(the VARIANTS entry, the SUFFIXES it carries) of a --variants name."""
    suffixes: set[str] = set()
    while found := next((suffix for suffix in SUFFIXES if name.endswith(suffix)), None):
        suffixes.add(found)
        name = name.removesuffix(found)
    if name not in VARIANTS:
        raise SystemExit(f"unknown variant {name!r}: one of {', '.join(VARIANTS)}, with any of {', '.join(SUFFIXES)}")
    return name, suffixes


def measure_decode(llm: LLM, prompt: list[int], steps: int, warmup: int) -> dict[str, Any]:
    """Time `steps` decode steps of one request after its prefill and `warmup` steps."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=warmup + steps + 2, ignore_eos=True)
    engine.add_request("decode-bench", prompt, params)
    seq = engine.core.scheduler.requests["decode-bench"].seqs[0]
    while seq.num_output_tokens == 0:
        engine.step()  # the prompt, in chunks
    for _ in range(warmup):
        engine.step()
    first_context = seq.num_tokens  # the KV read by the first timed step
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.abort_request("decode-bench")
    runner = engine.core.runner
    kv_bytes = (first_context + (steps - 1) / 2) * engine.facts.model_config.kv_bytes_per_token(runner.kv_cache_dtype)
    step_s = statistics.median(times)
    weights = streamed_weight_bytes(runner.model)
    return {
        "cuda_graphs": runner.graphs is not None,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(runner.kv_cache_dtype).removeprefix("torch."),
        "kv_pool_tokens": runner.num_blocks * runner.block_size,
        "attention_backend": runner.attn_backend.name,
        "steps": steps,
        "step_ms_median": step_s * 1e3,
        "step_ms_mean": statistics.fmean(times) * 1e3,
        "tok_s": 1 / step_s,
        "weight_bytes": weights,
        "kv_bytes_per_step": kv_bytes,
        "achieved_gbs": (weights + kv_bytes) / step_s / GB,
    }


def streamed_weight_bytes(model) -> int:
    """Bytes of the parameters a decode step reads whole: all but the embedding table, whose rows are
    gathered (unless it is tied to the lm_head, which reads it whole)."""
    tied = getattr(model, "lm_head", None) is None
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if tied or "embed_tokens" not in name)


def use_linear_configs(path: str) -> dict[str, Any]:
    """Put the tiles gpu_linear.py found best into triton_linear (before any engine captures its graphs):
    per weight kind, and at one row per shape where the sweep found tiles faster than the product's."""
    import json

    from llmserve.model import triton_linear

    found = json.loads(Path(path).read_text())
    best, by_shape = found["best_configs"], found.get("best_shape_configs", {})
    for key, config in best.items():
        kind, one_row = key.split(",")
        triton_linear._CONFIGS[(kind, one_row == "1")] = triton_linear.TileConfig(*config)
    for key, (config, _, _) in by_shape.items():
        kind, n, k = key.split(",")
        triton_linear._SHAPE_CONFIGS[(kind, int(n), int(k))] = triton_linear.TileConfig(*config)
    print(f"triton_linear tiles from {path}: {best}, by shape {by_shape}", flush=True)
    return {"by_kind": best, "by_shape": by_shape}


def profile_steps(llm: LLM, prompt: list[int], steps: int) -> dict[str, Any]:
    """Device time per step of each kernel over `steps` decode steps, grouped by kind."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True)
    engine.add_request("decode-profile", prompt, params)
    seq = engine.core.scheduler.requests["decode-profile"].seqs[0]
    while seq.num_output_tokens < 8:
        engine.step()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - start) / steps
    engine.abort_request("decode-profile")
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if "CUDA" in str(getattr(event, "device_type", "")):
            kernels.setdefault(event.name, []).append(event.time_range.elapsed_us())
    rows = sorted(((name, len(t) / steps, sum(t) / steps) for name, t in kernels.items()), key=lambda r: -r[2])
    groups: dict[str, float] = {}
    for name, _, us in rows:
        groups[kernel_kind(name)] = groups.get(kernel_kind(name), 0.0) + us
    return {"steps": steps, "wall_ms_per_step": wall * 1e3, "kernel_ms_per_step": sum(r[2] for r in rows) / 1e3,
            "groups_us": dict(sorted(groups.items(), key=lambda kv: -kv[1])),
            "kernels": [{"name": n[:160], "calls_per_step": c, "us_per_step": us} for n, c, us in rows[:40]]}


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    for kind, marks in (("linear (triton_linear)", ("gemv_kernel", "small_m_kernel")),
                        ("linear (int8 matmul)", ("w8a16",)),
                        ("linear (library)", ("gemm", "gemv", "sm90", "cutlass", "xmma", "splitk", "scaled_mm")),
                        ("attention", ("attention", "attn", "decode_kernel", "prefill", "reduce_splits")),
                        ("rotary + kv write", ("rotary_write_kv",)),
                        ("kv write", ("write_kv", "reshape_and_cache")),
                        ("norms", ("rms_norm",)), ("rotary", ("rotary",)), ("silu", ("silu",)),
                        ("copies", ("memcpy", "copy", "fill", "index", "gather", "cat")),
                        ("sampler / logits", ("argmax", "reduce", "softmax", "max", "sort", "topk"))):
        if any(mark in lowered for mark in marks):
            return kind
    return "other"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint or config-only dir (default: make-model --size 8b)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, a few steps")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--modes", default="graphs,eager", help="graphs (the default engine) and/or eager")
    ap.add_argument("--variants", default="bf16",
                    help=f"comma-separated, of {', '.join(VARIANTS)}, each also with any of {', '.join(SUFFIXES)}")
    ap.add_argument("--profile", action="store_true", help="kernel times of each graphs run's steps")
    ap.add_argument("--linear-configs", default=None,
                    help="gpu_linear.py's JSON: run triton_linear with the tiles its sweep found best")
    ap.add_argument("--copy-gib", type=float, default=4.0, help="bytes moved by one bandwidth-probe copy")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompt_len, args.steps, args.warmup, args.max_model_len = 16, 6, 2, 128
        args.modes, args.copy_gib = "eager", 0.0625

    device = bench_device(args.smoke)
    path = model_dir(args.model, args.smoke)
    tiles = use_linear_configs(args.linear_configs) if args.linear_configs else None
    copy_gbs = copy_bandwidth_gbs(device, int(args.copy_gib * (1 << 30)))
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s", flush=True)
    result: dict[str, Any] = {"model": path, "machine": machine_info(device), "copy_gbs": copy_gbs,
                              "args": vars(args), "triton_linear_tiles": tiles, "runs": []}
    # the settings of LLMSERVE_PDL, LLMSERVE_FOLD_NORMS and LLMSERVE_FOLD_ROTARY
    pdl_default, norms_default, rotary_default = pdl.enabled, layers.fold_norms, triton_backend.fold_rotary
    for variant in args.variants.split(","):
        base, suffixes = split_variant(variant)
        engine_overrides, layers.cuda_linear_path = VARIANTS[base]
        pdl.enabled = pdl_default and NO_PDL_SUFFIX not in suffixes
        layers.fold_norms = norms_default or FOLD_NORMS_SUFFIX in suffixes
        triton_backend.fold_rotary = rotary_default or FOLD_ROTARY_SUFFIX in suffixes
        for mode in args.modes.split(","):
            llm = LLM(path, **engine_args(args.smoke, max_model_len=args.max_model_len, max_num_seqs=1,
                                          enforce_eager=mode == "eager", **engine_overrides))
            prompt = random_prompts(1, (args.prompt_len, args.prompt_len), llm.get_tokenizer().vocab_size, seed=0)[0]
            launched_pdl = pdl.launch_options(torch.empty(0, device=device))["PDL"]  # False where unsupported
            run = {"variant": variant, "mode": mode, "pdl": launched_pdl, "fold_norms": layers.fold_norms,
                   "fold_rotary": triton_backend.fold_rotary,
                   **measure_decode(llm, prompt, args.steps, args.warmup)}
            run["pct_of_copy_bw"] = 100 * run["achieved_gbs"] / copy_gbs
            if args.profile and mode == "graphs":
                run["profile"] = profile_steps(llm, prompt, min(args.steps, 32))
                print_profile(variant, run["profile"])
            result["runs"].append(run)
            print(f"  {variant} {mode}: {run['step_ms_median']:.2f} ms/step, {run['achieved_gbs']:.0f} GB/s, "
                  f"KV pool {run['kv_pool_tokens']} tokens{', PDL' if launched_pdl else ''}", flush=True)
            del llm
            free_device_memory(device)
    layers.cuda_linear_path, pdl.enabled = "auto", pdl_default
    layers.fold_norms, triton_backend.fold_rotary = norms_default, rotary_default
    bf16 = [r for r in result["runs"] if r["variant"] == "bf16"] or result["runs"]
    best = max(bf16, key=lambda r: r["pct_of_copy_bw"])
    result["goal"] = {"pct_of_copy_bw": GOAL_PCT_OF_COPY_BW, "best": best["pct_of_copy_bw"],
                      "met": best["pct_of_copy_bw"] >= GOAL_PCT_OF_COPY_BW}
    print_summary(result)
    write_json(args.json, result)
    return result


def print_profile(variant: str, prof: dict[str, Any]) -> None:
    print(f"\n{variant}: {prof['wall_ms_per_step']:.3f} ms/step wall under the profiler, kernels "
          f"{prof['kernel_ms_per_step']:.3f} ms/step")
    for kind, us in prof["groups_us"].items():
        print(f"  {kind:<24} {us:9.1f} us/step")
    for k in prof["kernels"][:25]:
        print(f"    {k['us_per_step']:9.1f} us  x{k['calls_per_step']:<6.1f} {k['name'][:110]}")


def print_summary(result: dict[str, Any]) -> None:
    rows = [
        [r["variant"], r["mode"], "yes" if r["cuda_graphs"] else "no", r["attention_backend"], r["kv_cache_dtype"],
         str(r["kv_pool_tokens"]), f"{r['step_ms_median']:.2f}",
         f"{r['tok_s']:.1f}", f"{r['weight_bytes'] / GB:.2f}", f"{r['kv_bytes_per_step'] / 1e6:.1f}",
         f"{r['achieved_gbs']:.0f}", f"{result['copy_gbs']:.0f}", f"{r['pct_of_copy_bw']:.0f}%"]
        for r in result["runs"]
    ]
    dtypes = ", ".join(sorted({r["dtype"] for r in result["runs"]}))
    print_table(
        f"Batch-1 decode ({dtypes}, median step)",
        ["variant", "mode", "CUDA graphs", "attention", "KV dtype", "KV pool tokens", "ms/step", "tok/s", "weights GB",
         "KV MB/step", "achieved GB/s",
         "copy GB/s", "% of copy BW"],
        rows,
    )
    goal = result["goal"]
    print(f"\ngoal >= {goal['pct_of_copy_bw']:.0f}% of copy bandwidth (bf16): best {goal['best']:.0f}% "
          f"({'met' if goal['met'] else 'not met'})")


if __name__ == "__main__":
    main()
