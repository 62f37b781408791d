"""CPU batch-1 decode of llmserve (bf16, or int8 weights with --quantization int8) against llama.cpp (BF16,
Q8_0) and transformers (bf16), same weights.

Rounds alternate the systems, so a noisy neighbour slows them alike; each round reports its own ratios:
  - llmserve in three modes switched at run time in one process (--modes): `step`, small steps in one C
    call (`cpu_decode`, the default); `kernels`, the per-module forward pass with the CPU kernels
    (`cpu_linear`, `cpu_fused`); `torch`, without them (F.linear and the torch ops, as before issue 18;
    with --quantization int8, torch's `_weight_int8pack_mm`).
    Decode also reports each mode's process CPU time per step (robust to neighbours' load);
  - llama.cpp's `llama-bench` on GGUF conversions of the same checkpoint (skipped, with a message, when the
    build is missing: see benchmarks/llama_cpp.sh), with its CPU time per decoded token (a run of 1 token
    subtracted from the decode run);
  - transformers generate, bf16 (--skip-hf to leave it out).
Workloads: batch-1 decode of 128 tokens after a 128-token prompt (tok/s of the 127 tokens after the first;
--best-window: also of the fastest W consecutive steps, for machines shared with other jobs),
prefill of 512 tokens (tok/s), --batch-sizes: N sequences decoding together (output tok/s of the decode steps,
against llama.cpp's llama-batched-bench), and --batch64: 64 sequences of 128 in + 128 out (output tok/s).
The machine's read bandwidth (float32 sum of 1 GiB over torch's threads) is measured in each round, and
decode is reported as weight bytes per second and % of it.

    bash benchmarks/llama_cpp.sh            # once: builds llama-bench, converts the model (~/.cache/llmserve-bench)
    python benchmarks/batch1_decode.py --rounds 3 --batch64 --json bench_out/batch1_decode.json
    python benchmarks/batch1_decode.py --threads 1 ...   # one core: robust to busy neighbours
    python benchmarks/batch1_decode.py --quantization int8 ...   # int8 weights, against llama.cpp Q8_0
    python benchmarks/batch1_decode.py --quantization int8 --quantize-lm-head ...   # the lm_head in int8 too, as Q8_0
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch

from llmserve import LLM, SamplingParams
from llmserve.model import cpu_decode, cpu_linear, layers
from llmserve.model.builtin import ensure_default_model

BENCH_CACHE = Path(os.environ.get("LLMSERVE_BENCH_CACHE", Path.home() / ".cache" / "llmserve-bench"))


def read_bandwidth_gbs() -> float:
    x = torch.ones(1 << 28)  # 1 GiB of float32
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return x.numel() * 4 / best / 1e9


def anon_huge_page_mb() -> float:
    """MB of this process's memory on transparent huge pages (the weights are meant to be: model/huge_pages.py)."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def streamed_weight_bytes(cfg, quantization: str | None, quantize_lm_head: bool = False) -> int:
    """Bytes of weights a decode step reads: all but the embedding table (unless tied to the lm_head), with
    the decoder's linear layers (and the lm_head with `quantize_lm_head`) at one byte per weight under int8
    (their scales left out: < 0.1%)."""
    head = cfg.vocab_size * cfg.hidden_size
    bf16_bytes = 2 * (cfg.num_parameters() - (0 if cfg.tie_word_embeddings else head))
    if quantization is None:
        return bf16_bytes
    h, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    linear = cfg.num_hidden_layers * (h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size)
    return bf16_bytes - linear - (head if quantize_lm_head else 0)


MODES = ("step", "kernels", "torch")


def use_mode(mode: str) -> None:
    """`mode` is one of MODES, optionally with @path: the kernels' implementation (cpu_linear.PATHS, e.g.
    step@avx2), for a baseline on a CPU with a faster one."""
    name, _, path = mode.partition("@")
    cpu_decode.use_fast_path(name == "step")
    cpu_linear.use_kernel(name != "torch")
    cpu_linear.use_path(path or "best")
    layers.use_fused_kernels = None if name != "torch" else False


# ---- llmserve -------------------------------------------------------------------------------------
def llmserve_decode(llm: LLM, prompt: list[int], new_tokens: int, window: int) -> tuple[float, float, float]:
    """(tok/s, process CPU ms per step, tok/s of the fastest `window` consecutive steps) of the decode steps
    after the first token (the prefill step is not timed)."""
    engine = llm.engine
    engine.add_request("decode", prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    engine.step()  # prefill + first token
    t, cpu = time.perf_counter(), time.process_time()
    step_times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    cpu_ms = (time.process_time() - cpu) / (new_tokens - 1) * 1e3
    decodes = step_times[: new_tokens - 1]  # the last step only hands over the last token
    best = min(sum(decodes[i : i + window]) for i in range(len(decodes) - window + 1)) if window else 0.0
    return (new_tokens - 1) / (time.perf_counter() - t), cpu_ms, window / best if window else 0.0


def llmserve_batch_decode(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    """Output tok/s of the decode steps of len(prompts) sequences decoding together, once every prompt is
    prefilled (the steps that prefill are not timed)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"batch-{len(prompts)}-{i}", prompt, params)
    started: set[str] = set()
    while len(started) < len(prompts):  # every sequence's first token comes with its prefill
        started |= {out.request_id for out in engine.step() if out.outputs[0].token_ids}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return len(prompts) * (new_tokens - 1) / (time.perf_counter() - start)


def llmserve_prefill(llm: LLM, prompt: list[int]) -> float:
    """tok/s of a prompt's prefill (a prompt not seen before: prefix caching would skip it)."""
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    return len(prompt) / (time.perf_counter() - t)


def llmserve_batch(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return produced / (time.perf_counter() - t)


# ---- transformers ---------------------------------------------------------------------------------
@torch.inference_mode()
def hf_decode(model, prompt: list[int], new_tokens: int) -> float:
    ids = torch.tensor([prompt])

    def generate(n: int) -> float:
        return _timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                             min_new_tokens=n, do_sample=False, pad_token_id=0))

    return (new_tokens - 1) / (generate(new_tokens) - generate(1))


# ---- llama.cpp ------------------------------------------------------------------------------------
def llama_bench_binary(name: str = "llama-bench") -> Path | None:
    for candidate in BENCH_CACHE.glob(f"llama_cpp_python-*/vendor/llama.cpp/build/bin/{name}"):
        return candidate
    found = shutil.which(name)
    return Path(found) if found else None


def llama_bench(binary: Path, gguf: Path, threads: int, prompt: int, generate: int, depth: int) -> tuple[float, float]:
    """(tok/s that llama-bench reports for one test (-p prompt tokens or -n generated tokens at -d depth),
    the CPU seconds of the whole run: loading, warm-up and the test)."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", str(prompt), "-n", str(generate),
           "-d", str(depth), "-r", "1", "-o", "json"]
    before = _children_cpu_s()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(json.loads(out)[0]["avg_ts"]), _children_cpu_s() - before


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def llama_bench_best_window(binary: Path, gguf: Path, threads: int, window: int, depth: int, reps: int) -> float:
    """tok/s of the fastest of `reps` runs of `window` generated tokens at `depth`."""
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(window), "-d", str(depth),
           "-r", str(reps), "-o", "json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return window / (min(json.loads(out)[0]["samples_ns"]) / 1e9)


def llama_batched_bench(binary: Path, gguf: Path, threads: int, batch_sizes: list[int], prompt: int,
                        generate: int) -> dict[int, float]:
    """Output tok/s of llama.cpp's decode steps (`llama-batched-bench` S_TG) for each number of sequences
    decoding together, after a prompt of `prompt` tokens each."""
    context = max(batch_sizes) * (prompt + generate) + 64
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-c", str(context), "-b", "2048", "-ub", "512",
           "-npp", str(prompt), "-ntg", str(generate), "-npl", ",".join(map(str, batch_sizes)),
           "--output-format", "jsonl"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {row["pl"]: row["speed_tg"] for row in rows}


def llama_bench_decode(binary: Path, gguf: Path, threads: int, generate: int, depth: int) -> tuple[float, float]:
    """(decode tok/s, CPU ms per decoded token): the CPU time of a run that generates `generate` tokens less
    that of one generating 1, so loading, the context's prefill and the warm-up cancel out."""
    tok_s, cpu_s = llama_bench(binary, gguf, threads, 0, generate, depth)
    _, cpu_one_s = llama_bench(binary, gguf, threads, 0, 1, depth)
    return tok_s, (cpu_s - cpu_one_s) / (generate - 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: built-in llama medium)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--batch64", action="store_true", help="also 64 sequences x (128 in + 128 out)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--gguf-dir", default=str(BENCH_CACHE / "gguf"))
    ap.add_argument("--threads", type=int, default=None, help="torch and llama.cpp threads (default: torch's)")
    ap.add_argument("--modes", default=",".join(MODES), help="llmserve modes to run, comma-separated (first: the "
                    "one compared with the others; prefill and batch 64 run in the first and the last); "
                    "MODE@PATH runs the kernels on PATH (e.g. step@avx2)")
    ap.add_argument("--best-window", type=int, default=0, metavar="W",
                    help="also the tok/s of the fastest W consecutive decode steps (llama.cpp: the fastest of "
                    "--new-tokens / W runs of W tokens): what each reaches when the neighbours leave it the cores")
    ap.add_argument("--quantization", choices=["int8"], default=None,
                    help="llmserve's weights quantized at load (compare with llama.cpp Q8_0)")
    ap.add_argument("--quantize-lm-head", action="store_true",
                    help="with --quantization: the lm_head too (llama.cpp's Q8_0 conversion quantizes it)")
    ap.add_argument("--batch-sizes", default="", metavar="N,N,...",
                    help="also N sequences decoding together (e.g. 2,4,8): output tok/s of the decode steps, against "
                    "llama.cpp's llama-batched-bench (built by benchmarks/llama_cpp.sh)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    batch_sizes = [int(n) for n in args.batch_sizes.split(",") if n]
    modes = args.modes.split(",")
    if not modes or any(m.partition("@")[0] not in MODES or m.partition("@")[2] not in ("", *cpu_linear.PATHS)
                        for m in modes):
        ap.error(f"--modes: choose from {', '.join(MODES)}, each optionally @{'|'.join(cpu_linear.PATHS)}")
    if args.threads:
        torch.set_num_threads(args.threads)

    model_dir = args.model or str(ensure_default_model("llama", "medium"))
    threads = torch.get_num_threads()
    llm = LLM(model_dir, dtype="bfloat16", kv_cache_memory=2 << 30, max_num_seqs=64, quantization=args.quantization,
              quantize_lm_head=args.quantize_lm_head)
    cfg = llm.engine.facts.model_config
    weight_bytes = streamed_weight_bytes(cfg, args.quantization, args.quantize_lm_head)
    rng = random.Random(0)
    vocab = cfg.vocab_size
    prompt = [rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)]

    def fresh(length: int) -> list[int]:
        return [rng.randrange(10, vocab - 10) for _ in range(length)]

    binary = llama_bench_binary()
    batched_binary = llama_bench_binary("llama-batched-bench")
    if batch_sizes and batched_binary is None:
        print("llama.cpp: llama-batched-bench not found; build it with `bash benchmarks/llama_cpp.sh` (skipped)")
    ggufs = {name: Path(args.gguf_dir) / f"{Path(model_dir).name}-{name}.gguf" for name in ("bf16", "q8_0")}
    if binary is None:
        print("llama.cpp: llama-bench not found; build it with `bash benchmarks/llama_cpp.sh` (skipped)")
    ggufs = {name: path for name, path in ggufs.items() if binary is not None and path.exists()}
    if binary is not None and len(ggufs) < 2:
        print(f"llama.cpp: GGUF files missing in {args.gguf_dir}; run `bash benchmarks/llama_cpp.sh` (skipped)")
    hf = None
    if not args.skip_hf:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()

    use_mode(modes[0])
    llm.generate([prompt[:16]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    rounds = []
    for r in range(args.rounds):
        row: dict[str, float] = {"read_gbs": read_bandwidth_gbs(), "huge_page_mb": anon_huge_page_mb()}
        for mode in modes:
            use_mode(mode)
            decode, cpu_ms, best = llmserve_decode(llm, prompt, args.new_tokens, args.best_window)
            row[f"llmserve_{mode}_decode"], row[f"llmserve_{mode}_cpu_ms_per_step"] = decode, cpu_ms
            if args.best_window:
                row[f"llmserve_{mode}_best_window_decode"] = best
            for n in batch_sizes:
                row[f"llmserve_{mode}_batch{n}_decode"] = llmserve_batch_decode(
                    llm, [fresh(args.prompt_len) for _ in range(n)], args.new_tokens
                )
            if mode in (modes[0], modes[-1]):  # prefill and batch 64 never take the one-call step
                row[f"llmserve_{mode}_prefill"] = llmserve_prefill(llm, fresh(args.prefill_len))
                if args.batch64:
                    row[f"llmserve_{mode}_batch64"] = llmserve_batch(llm, [fresh(128) for _ in range(64)], 128)
        use_mode(modes[0])
        for name, path in ggufs.items():
            row[f"llama_cpp_{name}_decode"], row[f"llama_cpp_{name}_cpu_ms_per_token"] = llama_bench_decode(
                binary, path, threads, args.new_tokens, args.prompt_len
            )
            row[f"llama_cpp_{name}_prefill"] = llama_bench(binary, path, threads, args.prefill_len, 0, 0)[0]
            if args.best_window:
                row[f"llama_cpp_{name}_best_window_decode"] = llama_bench_best_window(
                    binary, path, threads, args.best_window, args.prompt_len, max(1, args.new_tokens // args.best_window)
                )
        reference = "q8_0" if args.quantization == "int8" else "bf16"
        if batch_sizes and batched_binary is not None and reference in ggufs:
            speeds = llama_batched_bench(batched_binary, ggufs[reference], threads, batch_sizes, args.prompt_len,
                                         args.new_tokens)
            for n in batch_sizes:
                row[f"llama_cpp_{reference}_batch{n}_decode"] = speeds[n]
                row[f"llmserve_vs_llama_cpp_{reference}_batch{n}"] = (
                    row[f"llmserve_{modes[0]}_batch{n}_decode"] / speeds[n]
                )
        if hf is not None:
            row["hf_decode"] = hf_decode(hf, prompt, args.new_tokens)
        decode = row[f"llmserve_{modes[0]}_decode"]
        row["llmserve_weight_gbs"] = decode * weight_bytes / 1e9
        row["pct_read_bw"] = 100 * row["llmserve_weight_gbs"] / row["read_gbs"]
        for other in modes[1:]:
            row[f"{modes[0]}_vs_{other}_decode"] = decode / row[f"llmserve_{other}_decode"]
        if f"llama_cpp_{reference}_decode" in row:
            row[f"llmserve_vs_llama_cpp_{reference}_decode"] = decode / row[f"llama_cpp_{reference}_decode"]
            # by CPU time per token: what each costs, whatever the neighbours take
            row[f"llmserve_vs_llama_cpp_{reference}_cpu"] = (
                row[f"llama_cpp_{reference}_cpu_ms_per_token"] / row[f"llmserve_{modes[0]}_cpu_ms_per_step"]
            )
            if args.best_window:
                row[f"llmserve_vs_llama_cpp_{reference}_best_window"] = (
                    row[f"llmserve_{modes[0]}_best_window_decode"] / row[f"llama_cpp_{reference}_best_window_decode"]
                )
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
        rounds.append(row)

    medians = {k: statistics.median(row[k] for row in rounds) for k in rounds[0]}
    print("medians: " + ", ".join(f"{k} {v:.2f}" for k, v in medians.items()))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "model": model_dir, "weight_bytes": weight_bytes, "threads": threads, "args": vars(args),
            "llama_bench": str(binary) if binary else None, "rounds": rounds, "medians": medians,
        }, indent=2))


if __name__ == "__main__":
    main()
