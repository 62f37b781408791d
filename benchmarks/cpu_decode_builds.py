"""Builds of the one-call CPU decode step (csrc/decode_llama_cpu.c and the kernels it includes) against each
other on one engine, end to end.

Each variant is a set of the kernels' tuning constants (NAME=VALUE, over this CPU's `cpu_linear.TUNING`), e.g.
BF16_ONE_ROW_PREFETCH, WEIGHT_PREFETCH_BYTES, KV_PREFETCH_BLOCKS. One engine on the built-in `medium` model
(bf16) decodes with each build in turn, the order alternating every round, so the builds see the same
moments of a machine whose memory speed drifts: batch-1 decode tok/s of --new-tokens after --prompt-len, per
round, and each build's ratio to the first one per round. A variant ending in @PATH runs the kernels on that
implementation (cpu_linear.PATHS), to compare the paths a CPU builds.

    python benchmarks/cpu_decode_builds.py --variants "BF16_ONE_ROW_PREFETCH=0;BF16_ONE_ROW_PREFETCH=1" --rounds 8
    python benchmarks/cpu_decode_builds.py --variants "@avx512;@avx2" --quantization int8 --rounds 8
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from llmserve import LLM, SamplingParams
from llmserve.model import cpu_decode, cpu_linear
from llmserve.model.builtin import ensure_default_model


def decode_tok_s(llm: LLM, prompt: list[int], new_tokens: int) -> float:
    """tok/s of the decode steps after the first token of one request."""
    engine = llm.engine
    engine.add_request(f"builds-{time.monotonic_ns()}", prompt,
                       SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    engine.step()  # prefill + first token
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (new_tokens - 1) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", required=True,
                    help="builds separated by ';', each a comma-separated list of NAME=VALUE ('' for the default)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--quantization", choices=["int8"], default=None)
    ap.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    specs = [spec.partition("@") for spec in args.variants.split(";")]
    variants = [(tuple(d for d in defines.split(",") if d), path or "best") for defines, _, path in specs]
    if unknown := {path for _, path in variants} - set(cpu_linear.PATHS):
        ap.error(f"unknown kernel paths {sorted(unknown)}: choose from {sorted(cpu_linear.PATHS)}")
    llm = LLM(str(ensure_default_model("llama", "medium")), dtype="bfloat16", kv_cache_memory=1 << 30,
              enable_prefix_caching=False, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    runner = llm.engine.core.runner
    if runner.cpu_decoder is None:
        raise SystemExit("the one-call decode step does not run here (no kernels, or a model it cannot take)")
    decoders = {}
    for defines, _ in variants:
        lib = cpu_decode.load(defines)
        if lib is None:
            raise SystemExit(f"the build {defines} failed")
        decoders[defines] = cpu_decode.CpuDecoder(runner.model, runner.kv_caches, runner.attn_backend, lib)
    rng = random.Random(0)
    prompt = [rng.randrange(10, 31990) for _ in range(args.prompt_len)]
    llm.generate([prompt[:16]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    results: dict[tuple[tuple[str, ...], str], list[float]] = {variant: [] for variant in variants}
    for r in range(args.rounds):
        for defines, path in variants if r % 2 == 0 else variants[::-1]:
            runner.cpu_decoder = decoders[defines]
            cpu_linear.use_path(path)
            results[(defines, path)].append(decode_tok_s(llm, prompt, args.new_tokens))
    cpu_linear.use_path("best")
    first = results[variants[0]]
    names = {variant: f"{','.join(variant[0]) or 'default'}@{variant[1]}" for variant in variants}
    for variant, runs in results.items():
        ratios = [a / b for a, b in zip(runs, first, strict=True)]
        print(f"{names[variant]}: median {statistics.median(runs):.1f} tok/s, runs "
              f"{[round(x, 1) for x in runs]}; to the first build per round {[round(x, 2) for x in ratios]}, "
              f"median {statistics.median(ratios):.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args), "tuning": list(cpu_linear.TUNING),
                                         "runs": {names[variant]: runs for variant, runs in results.items()}},
                                        indent=2, default=str))


if __name__ == "__main__":
    main()
