"""Batch-1 decode on the Llama-3.1-8B shape in bfloat16 (dummy weights): tokens/s and achieved HBM
bandwidth against the device's copy bandwidth measured in the same run.

A decode step reads every weight once (the embedding table aside: its rows are gathered) and the KV
of the whole context, so  achieved bandwidth = (weight bytes + KV bytes read) / step time,  with the
step timed end to end around `engine.step()` (scheduling, input preparation, forward, sampling and the
read of the sampled id). Copy bandwidth: a large device-to-device copy, 2 * bytes / time. Goal: >= 80%.

    python benchmarks/gpu_decode.py --json bench_out/gpu/decode.json
    python benchmarks/gpu_decode.py --smoke        # CPU, tiny model: checks the script, not the GPU
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

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
    weight_bytes_per_step,
    write_json,
)

from llmserve import LLM, SamplingParams

GOAL_PCT_OF_COPY_BW = 80.0


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
    kv_bytes = (first_context + (steps - 1) / 2) * engine.facts.model_config.kv_bytes_per_token(runner.dtype)
    step_s = statistics.median(times)
    weights = weight_bytes_per_step(engine.facts.model_config, runner.dtype)
    return {
        "cuda_graphs": runner.graphs is not None,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "attention_backend": runner.attn_backend.name,
        "steps": steps,
        "step_ms_median": step_s * 1e3,
        "step_ms_mean": statistics.fmean(times) * 1e3,
        "tok_s": 1 / step_s,
        "weight_bytes": weights,
        "kv_bytes_per_step": kv_bytes,
        "achieved_gbs": (weights + kv_bytes) / step_s / GB,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint or config-only dir (default: make-model --size 8b)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, a few steps")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--modes", default="graphs,eager", help="graphs (the default engine) and/or eager")
    ap.add_argument("--copy-gib", type=float, default=4.0, help="bytes moved by one bandwidth-probe copy")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompt_len, args.steps, args.warmup, args.max_model_len = 16, 6, 2, 128
        args.modes, args.copy_gib = "eager", 0.0625

    device = bench_device(args.smoke)
    path = model_dir(args.model, args.smoke)
    copy_gbs = copy_bandwidth_gbs(device, int(args.copy_gib * (1 << 30)))
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s", flush=True)
    result: dict[str, Any] = {"model": path, "machine": machine_info(device), "copy_gbs": copy_gbs,
                              "args": vars(args), "runs": []}
    for mode in args.modes.split(","):
        llm = LLM(path, **engine_args(args.smoke, max_model_len=args.max_model_len, max_num_seqs=1,
                                      enforce_eager=mode == "eager"))
        prompt = random_prompts(1, (args.prompt_len, args.prompt_len), llm.get_tokenizer().vocab_size, seed=0)[0]
        run = {"mode": mode, **measure_decode(llm, prompt, args.steps, args.warmup)}
        run["pct_of_copy_bw"] = 100 * run["achieved_gbs"] / copy_gbs
        result["runs"].append(run)
        print(f"  {mode}: {run['step_ms_median']:.2f} ms/step, {run['achieved_gbs']:.0f} GB/s", flush=True)
        del llm
        free_device_memory(device)
    best = max(result["runs"], key=lambda r: r["pct_of_copy_bw"])
    result["goal"] = {"pct_of_copy_bw": GOAL_PCT_OF_COPY_BW, "best": best["pct_of_copy_bw"],
                      "met": best["pct_of_copy_bw"] >= GOAL_PCT_OF_COPY_BW}
    print_summary(result)
    write_json(args.json, result)
    return result


def print_summary(result: dict[str, Any]) -> None:
    rows = [
        [r["mode"], "yes" if r["cuda_graphs"] else "no", r["attention_backend"], f"{r['step_ms_median']:.2f}",
         f"{r['tok_s']:.1f}", f"{r['weight_bytes'] / GB:.2f}", f"{r['kv_bytes_per_step'] / 1e6:.1f}",
         f"{r['achieved_gbs']:.0f}", f"{result['copy_gbs']:.0f}", f"{r['pct_of_copy_bw']:.0f}%"]
        for r in result["runs"]
    ]
    dtypes = ", ".join(sorted({r["dtype"] for r in result["runs"]}))
    print_table(
        f"Batch-1 decode ({dtypes}, median step)",
        ["mode", "CUDA graphs", "attention", "ms/step", "tok/s", "weights GB", "KV MB/step", "achieved GB/s",
         "copy GB/s", "% of copy BW"],
        rows,
    )
    goal = result["goal"]
    print(f"\ngoal >= {goal['pct_of_copy_bw']:.0f}% of copy bandwidth: best {goal['best']:.0f}% "
          f"({'met' if goal['met'] else 'not met'})")


if __name__ == "__main__":
    main()
