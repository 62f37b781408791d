"""Offline throughput on the Llama-3.1-8B shape in bfloat16 (dummy weights): llmserve against
`transformers` generate with static batches, on the same GPU in the same run.

Workload: N requests of random token ids, input and output lengths uniform in the given ranges (fixed
seed), ignore_eos, greedy. llmserve runs all N with continuous batching. transformers runs the same
requests in static batches of B left-padded prompts, each batch generating until its longest output;
only the tokens each request asked for count. Its model is built from the same config with random
weights in bf16 on the GPU. Running all N that way takes hours, so a sample of its batches (the first
K) is timed and its rate applied to the whole workload; the summary says so. Goal: >= 10x.

    python benchmarks/gpu_throughput.py --json bench_out/gpu/throughput.json
    python benchmarks/gpu_throughput.py --smoke    # CPU, tiny model: checks the script, not the GPU
    python benchmarks/gpu_throughput.py --host-only --skip-hf --num-prompts 512 --input-len 32:256 --output-len 32:512
        # CPU, tiny model at the full batch: a run dominated by the engine's host work
"""

from __future__ import annotations

import argparse
import math
import random
import time
from typing import Any

import torch
from gpu_common import (
    bench_device,
    engine_args,
    free_device_memory,
    machine_info,
    model_dir,
    parse_range,
    print_table,
    random_prompts,
    synchronize,
    write_json,
)

from llmserve import LLM, SamplingParams

GOAL_SPEEDUP = 10.0


def output_lengths(num: int, lengths: tuple[int, int], seed: int) -> list[int]:
    rng = random.Random(seed + 1)
    return [rng.randint(*lengths) for _ in range(num)]


def run_llmserve(path: str, prompts: list[list[int]], outputs: list[int], smoke: bool,
                 overrides: dict[str, Any]) -> dict[str, Any]:
    llm = LLM(path, **engine_args(smoke, **overrides))
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(r.outputs[0].token_ids) for r in results)
    if produced != sum(outputs):
        raise RuntimeError(f"llmserve produced {produced} tokens, expected {sum(outputs)}")
    stats = llm.engine.stats()
    runner = llm.engine.core.runner
    return {
        "output_tokens": produced,
        "input_tokens": sum(map(len, prompts)),
        "seconds": elapsed,
        "output_tok_s": produced / elapsed,
        "total_tok_s": (produced + sum(map(len, prompts))) / elapsed,
        "preemptions": stats.num_preemptions,
        "kv_blocks": runner.num_blocks,
        "cuda_graphs": runner.graphs is not None,
        "attention_backend": runner.attn_backend.name,
    }


def load_hf_model(path: str, device: torch.device, dtype: torch.dtype):
    """The transformers model for the same config, random weights, built directly on the device."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device(device):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        except TypeError:  # transformers 4.x names it torch_dtype
            model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    return model.to(device).eval()


@torch.inference_mode()
def run_hf_static(model, prompts: list[list[int]], outputs: list[int], batch_size: int, sample_batches: int,
                  device: torch.device) -> dict[str, Any]:
    """Time the first `sample_batches` static batches; extrapolate their rate to the whole workload."""
    num_batches = math.ceil(len(prompts) / batch_size)
    timed = min(sample_batches, num_batches)
    warm = torch.tensor([prompts[0][:8]], device=device)
    model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False, pad_token_id=0)
    seconds, useful = [], 0
    for index in range(timed):
        batch = prompts[index * batch_size:(index + 1) * batch_size]
        wanted = outputs[index * batch_size:(index + 1) * batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        longest = max(wanted)
        synchronize(device)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                             do_sample=False, pad_token_id=0)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
        if out.shape[1] - width != longest:
            raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, expected {longest}")
        useful += sum(wanted)
        print(f"  transformers static batch {index + 1}/{timed}: {seconds[-1]:.1f}s", flush=True)
    rate = useful / sum(seconds)
    return {
        "batch_size": batch_size,
        "batches_total": num_batches,
        "batches_timed": timed,
        "timed_seconds": sum(seconds),
        "timed_useful_tokens": useful,
        "output_tok_s": rate,
        "estimated_total_seconds": sum(outputs) / rate,
        "extrapolated": timed < num_batches,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint or config-only dir (default: make-model --size 8b)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, a handful of requests")
    ap.add_argument("--host-only", action="store_true",
                    help="tiny model on CPU with the given workload: measures the engine's host work, not a GPU")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", default="100:1024")
    ap.add_argument("--output-len", default="100:1024")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--hf-batch-size", type=int, default=128)
    ap.add_argument("--hf-sample-batches", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.num_prompts, args.input_len, args.output_len = 6, "4:24", "2:8"
        args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len = 4, 64, 128
        args.hf_batch_size, args.hf_sample_batches = 2, 1

    on_cpu = args.smoke or args.host_only
    device = bench_device(on_cpu)
    path = model_dir(args.model, on_cpu)
    overrides = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                 "max_model_len": args.max_model_len}
    if args.host_only:  # the tiny model's context; a KV pool that holds the whole batch
        overrides["max_model_len"] = min(args.max_model_len, 2048)
        longest = parse_range(args.input_len)[1] + parse_range(args.output_len)[1]
        overrides["num_kv_blocks"] = args.max_num_seqs * -(-longest // 16)
    from llmserve.tokenizer.tokenizer import Tokenizer

    vocab = Tokenizer.from_pretrained(path).vocab_size
    prompts = random_prompts(args.num_prompts, parse_range(args.input_len), vocab, args.seed)
    outputs = output_lengths(args.num_prompts, parse_range(args.output_len), args.seed)
    result: dict[str, Any] = {"model": path, "machine": machine_info(device), "args": vars(args)}
    print(f"llmserve: {args.num_prompts} requests, {sum(outputs)} output tokens ...", flush=True)
    result["llmserve"] = run_llmserve(path, prompts, outputs, on_cpu, overrides)
    print(f"  {result['llmserve']['output_tok_s']:.0f} output tok/s", flush=True)
    free_device_memory(device)
    if not args.skip_hf:
        dtype = torch.float32 if on_cpu else torch.bfloat16
        model = load_hf_model(path, device, dtype)
        print(f"transformers static batches of {args.hf_batch_size} ...", flush=True)
        result["transformers_static"] = run_hf_static(model, prompts, outputs, args.hf_batch_size,
                                                      args.hf_sample_batches, device)
        del model
        free_device_memory(device)
        speedup = result["llmserve"]["output_tok_s"] / result["transformers_static"]["output_tok_s"]
        result["goal"] = {"speedup": GOAL_SPEEDUP, "measured": speedup, "met": speedup >= GOAL_SPEEDUP}
    print_summary(result)
    write_json(args.json, result)
    return result


def print_summary(result: dict[str, Any]) -> None:
    ours = result["llmserve"]
    rows = [["llmserve (continuous batching, paged KV)", f"{ours['output_tok_s']:.0f}", f"{ours['seconds']:.0f}",
             "measured", "1.0"]]
    hf = result.get("transformers_static")
    if hf is not None:
        how = (f"{hf['batches_timed']} of {hf['batches_total']} batches timed, rest extrapolated"
               if hf["extrapolated"] else "all batches timed")
        rows.append([f"transformers generate, static batches of {hf['batch_size']}", f"{hf['output_tok_s']:.0f}",
                     f"{hf['estimated_total_seconds']:.0f}", how, f"{ours['output_tok_s'] / hf['output_tok_s']:.1f}x"])
    args = result["args"]
    print_table(
        f"Offline throughput: {args['num_prompts']} requests, input {args['input_len']}, output "
        f"{args['output_len']} tokens (random ids, ignore_eos, greedy)",
        ["system", "output tok/s", "seconds for the workload", "how", "llmserve / system"],
        rows,
    )
    if "goal" in result:
        goal = result["goal"]
        print(f"\ngoal >= {goal['speedup']:.0f}x transformers static batches: {goal['measured']:.1f}x "
              f"({'met' if goal['met'] else 'not met'})")


if __name__ == "__main__":
    main()
