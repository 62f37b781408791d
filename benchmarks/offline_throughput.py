"""Offline throughput of the llmserve engine against `transformers` generate, in one run.

Workload: N random-token prompts (input and output lengths uniform in the given ranges, fixed seed,
ignore_eos, greedy). Compares output tokens/s of
  - llmserve (continuous batching, paged KV cache, chunked prefill),
  - transformers generate one request at a time (a subset: its tokens/s is what counts),
  - transformers generate on static batches of padded prompts (each batch runs until its longest
    output is done; only the tokens each request asked for count as useful output).
It also reports per-decode-step GFLOP/s and weight GB/s at several batch sizes against this machine's
measured bf16 matmul rate and copy bandwidth, and the KV-cache waste at 64 running sequences.

    python benchmarks/offline_throughput.py --json bench_out/offline.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from llmserve import LLM, SamplingParams
from llmserve.model.builtin import ensure_default_model


def parse_range(text: str) -> tuple[int, int]:
    lo, hi = text.split(":")
    return int(lo), int(hi)


def make_workload(n: int, inputs: tuple[int, int], outputs: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    prompts, lengths = [], []
    for _ in range(n):
        prompts.append([rng.randrange(10, vocab - 10) for _ in range(rng.randint(*inputs))])
        lengths.append(rng.randint(*outputs))
    return prompts, lengths


# ---- machine roofline -----------------------------------------------------------------------------
def measure_machine() -> dict:
    x = torch.empty(512 * 1024 * 1024 // 4)
    y = torch.empty_like(x)
    y.copy_(x)
    t = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    copy_gbs = 2 * x.numel() * 4 * 5 / (time.perf_counter() - t) / 1e9
    del x, y
    a = torch.randn(2048, 2048, dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, dtype=torch.bfloat16)
    a @ b
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    matmul_gflops = 2 * 2048**3 * 10 / (time.perf_counter() - t) / 1e9
    return {"copy_bandwidth_gbs": copy_gbs, "bf16_matmul_gflops": matmul_gflops}


# ---- llmserve -------------------------------------------------------------------------------------
def run_llmserve(llm: LLM, prompts, lengths) -> dict:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(lengths)
    return {"output_tokens": produced, "seconds": elapsed, "output_tok_s": produced / elapsed,
            "preemptions": llm.engine.stats().num_preemptions}


def decode_roofline(llm: LLM, batch_sizes: list[int], context: int, machine: dict) -> list[dict]:
    engine = llm.engine
    cfg = engine.facts.model_config
    element = torch.empty((), dtype=engine.core.runner.dtype).element_size()
    weight_params = cfg.num_parameters() - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)
    weight_bytes = weight_params * element  # embedding rows are gathered, not streamed
    rows = []
    rng = random.Random(1)
    for batch in batch_sizes:
        ids = []
        for i in range(batch):
            rid = f"roof-{batch}-{i}"
            engine.add_request(rid, [rng.randrange(10, 1000) for _ in range(context)],
                               SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
            ids.append(rid)
        while any(s.num_output_tokens == 0 for r in engine.core.scheduler.requests.values() for s in r.seqs):
            engine.step()
        engine.step()
        steps = 8
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        step_s = (time.perf_counter() - t) / steps
        engine.abort_request(ids)
        ctx = context + 5
        flops = 2 * weight_params * batch + 4 * batch * ctx * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
        kv_bytes = batch * ctx * cfg.kv_bytes_per_token(engine.core.runner.dtype)
        rows.append({
            "batch": batch, "context": ctx, "step_ms": step_s * 1e3, "tok_s": batch / step_s,
            "gflops": flops / step_s / 1e9, "weight_gbs": weight_bytes / step_s / 1e9,
            "weight_plus_kv_gbs": (weight_bytes + kv_bytes) / step_s / 1e9,
            "pct_matmul_peak": 100 * flops / step_s / 1e9 / machine["bf16_matmul_gflops"],
            "pct_copy_bw": 100 * (weight_bytes + kv_bytes) / step_s / 1e9 / machine["copy_bandwidth_gbs"],
        })
        print(f"  decode batch {batch:4d}: {rows[-1]['step_ms']:.1f} ms/step", flush=True)
    return rows


def kv_waste(llm: LLM, prompts, lengths, running: int = 64) -> dict:
    """Reserved minus used KV slots over reserved, with `running` sequences mid-generation."""
    engine = llm.engine
    ids = []
    for i in range(min(running, len(prompts))):
        rid = f"waste-{i}"
        engine.add_request(rid, prompts[i], SamplingParams(temperature=0, max_tokens=lengths[i], ignore_eos=True))
        ids.append(rid)
    for _ in range(40):
        engine.step()
    seqs = engine.core.live_sequences()
    reserved = sum(len(s.block_table) for s in seqs) * engine.core.block_manager.block_size
    used = sum(s.num_computed_tokens for s in seqs)
    engine.abort_request(ids)
    return {"running": len(seqs), "reserved_slots": reserved, "used_slots": used,
            "waste_pct": 100 * (reserved - used) / reserved}


# ---- transformers baselines -----------------------------------------------------------------------
def load_hf(model_dir: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()


@torch.inference_mode()
def run_hf_single(model, prompts, lengths) -> dict:
    produced = 0
    t = time.perf_counter()
    for prompt, n in zip(prompts, lengths, strict=True):
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        produced += out.shape[1] - ids.shape[1]
    elapsed = time.perf_counter() - t
    return {"output_tokens": produced, "seconds": elapsed, "output_tok_s": produced / elapsed, "requests": len(prompts)}


@torch.inference_mode()
def run_hf_static(model, prompts, lengths, batch_size: int) -> dict:
    useful = 0
    t = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        batch, outs = prompts[start:start + batch_size], lengths[start:start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        longest = max(outs)
        model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                       do_sample=False, pad_token_id=0)
        useful += sum(outs)
        print(f"  static batch {start // batch_size + 1}: {time.perf_counter() - t:.0f}s", flush=True)
    elapsed = time.perf_counter() - t
    return {"output_tokens": useful, "seconds": elapsed, "output_tok_s": useful / elapsed,
            "requests": len(prompts), "batch_size": batch_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: built-in llama medium)")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", default="32:512")
    ap.add_argument("--output-len", default="16:512")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-single-prompts", type=int, default=16)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--hf-static-prompts", type=int, default=None, help="default: all prompts")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-cache-gib", type=float, default=6.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    model_dir = args.model or str(ensure_default_model("llama", "medium"))
    machine = measure_machine()
    print(f"machine: {machine}", flush=True)
    llm = LLM(model_dir, dtype="bfloat16", max_num_batched_tokens=args.max_num_batched_tokens,
              max_num_seqs=args.max_num_seqs, kv_cache_memory=int(args.kv_cache_gib * (1 << 30)))
    vocab = llm.engine.facts.model_config.vocab_size
    prompts, lengths = make_workload(args.num_prompts, parse_range(args.input_len), parse_range(args.output_len),
                                     vocab, args.seed)
    result = {"model": model_dir, "params": llm.engine.facts.model_config.num_parameters(), "dtype": "bfloat16",
              "workload": vars(args), "machine": {**machine, "cpu": platform.processor() or platform.machine(),
                                                   "threads": torch.get_num_threads()}}
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    print("llmserve ...", flush=True)
    result["llmserve"] = run_llmserve(llm, prompts, lengths)
    print(f"  {result['llmserve']}", flush=True)
    result["decode_roofline"] = decode_roofline(llm, [1, 8, 32, 64, 128], 256, machine)
    result["kv_waste"] = kv_waste(llm, prompts, lengths)
    print(f"  kv waste: {result['kv_waste']}", flush=True)
    del llm
    if not args.skip_hf:
        hf = load_hf(model_dir)
        n_single = args.hf_single_prompts
        print("transformers one at a time ...", flush=True)
        result["hf_single"] = run_hf_single(hf, prompts[:n_single], lengths[:n_single])
        print(f"  {result['hf_single']}", flush=True)
        n_static = args.hf_static_prompts or args.num_prompts
        print("transformers static batches ...", flush=True)
        result["hf_static"] = run_hf_static(hf, prompts[:n_static], lengths[:n_static], args.hf_batch_size)
        print(f"  {result['hf_static']}", flush=True)
        ours = result["llmserve"]["output_tok_s"]
        result["speedup_vs_hf_single"] = ours / result["hf_single"]["output_tok_s"]
        result["speedup_vs_hf_static"] = ours / result["hf_static"]["output_tok_s"]
    print_summary(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


def print_summary(r: dict) -> None:
    print("\n| system | output tok/s | ratio (ours / system) |\n|---|---|---|")
    ours = r["llmserve"]["output_tok_s"]
    print(f"| llmserve | {ours:.1f} | 1.0 |")
    for key, label in (("hf_single", "transformers, one at a time"), ("hf_static", "transformers, static batches")):
        if key in r:
            print(f"| {label} | {r[key]['output_tok_s']:.1f} | {ours / r[key]['output_tok_s']:.1f}x |")
    print("\n| batch | ms/step | tok/s | GFLOP/s | % matmul peak | weight GB/s | weight+KV GB/s | % copy BW |")
    print("|---|---|---|---|---|---|---|---|")
    for row in r["decode_roofline"]:
        print(f"| {row['batch']} | {row['step_ms']:.1f} | {row['tok_s']:.0f} | {row['gflops']:.0f} | "
              f"{row['pct_matmul_peak']:.0f}% | {row['weight_gbs']:.1f} | {row['weight_plus_kv_gbs']:.1f} | "
              f"{row['pct_copy_bw']:.0f}% |")
    w = r["kv_waste"]
    print(f"\nKV waste at {w['running']} running sequences: {w['waste_pct']:.2f}% "
          f"({w['reserved_slots'] - w['used_slots']} of {w['reserved_slots']} reserved slots unused)")


if __name__ == "__main__":
    main()
