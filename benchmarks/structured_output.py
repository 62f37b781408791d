"""What structured output costs: output tok/s of a batch with a JSON schema on every request against
the same batch unconstrained (same engine, alternating A/B rounds), grammar compile time over the
generated schemas (cold: a fresh compiler, no cache), and the time to first token a grammar adds.

Every constrained request gets one of the generated schemas wrapped as an array of 8 such documents,
so its grammar constrains every token up to max_tokens; both arms run exactly max_tokens tokens per
request (the unconstrained one with ignore_eos), so the batch stays full in both.

    python benchmarks/structured_output.py [--model DIR] [--batch 64] [--max-tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from llmserve import LLM, SamplingParams
from llmserve.bench.json_schemas import generate_schemas
from llmserve.engine.grammar import GrammarCompiler, GrammarSpec, tokenizer_info
from llmserve.model.builtin import make_model
from llmserve.sampling.params import StructuredOutputsParams

PROMPT = "Write the records as JSON:"


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


def _wrapped(schema: dict) -> str:
    return json.dumps({"type": "array", "items": schema, "minItems": 8, "maxItems": 8})


def throughput_round(llm: LLM, params: list[SamplingParams]) -> tuple[float, float]:
    """(output tokens per wall-clock second, per CPU second of this process). On a shared machine the
    CPU-time rate is the steadier one: other tenants' load stretches wall time, not our CPU time."""
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate([PROMPT] * len(params), params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return tokens / elapsed, tokens / cpu


def grammar_work_per_step(llm: LLM, schemas: list[str], steps: int) -> float:
    """Seconds of grammar work one step of the batch adds, measured on its own (steady, unlike a
    shared machine's step times): fill every row's mask, apply the masks in the sampler, advance
    every row's grammar by the token sampled from the masked logits."""
    core = llm.engine.core
    manager = core.structured_output
    states = [manager.new_state(manager.compile(GrammarSpec("json", s)).result(), []) for s in schemas]
    sampler = core.runner.sampler
    vocab = core.facts.model_config.vocab_size
    logits = torch.randn(len(states), vocab, generator=torch.Generator().manual_seed(0))
    rows = torch.arange(len(states))
    elapsed = 0.0
    for _ in range(steps):
        start = time.perf_counter()
        bitmask = manager.new_bitmask(len(states))
        for j, state in enumerate(states):
            state.fill_bitmask(bitmask, j)
        work = logits.clone()
        sampler._apply_token_bitmask_(work, rows, torch.from_numpy(bitmask))
        for state, token in zip(states, work.argmax(dim=1).tolist(), strict=True):
            state.accept(token)
        elapsed += time.perf_counter() - start
        logits = torch.randn_like(logits)
    return elapsed / steps


def ttft(llm: LLM, params: SamplingParams) -> float:
    out = llm.generate(PROMPT, params)[0]
    return out.metrics.first_token_time - out.metrics.arrival_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint dir (default: built-in medium, made once)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ttft-repeats", type=int, default=5)
    args = parser.parse_args()
    model_dir = Path(args.model or Path(os.environ.get("LLMSERVE_CACHE_DIR", "/tmp")) / "llmserve-medium")
    if not (model_dir / "config.json").exists():
        make_model(model_dir, "llama", "medium", 0)
    llm = LLM(str(model_dir), max_model_len=1024)
    facts = llm.engine.facts
    schemas = generate_schemas(200, seed=0)
    print(f"command: {' '.join(sys.argv)}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads")
    print(f"model: {model_dir} ({facts.model_config.architecture}, vocab {facts.model_config.vocab_size}, "
          f"{llm.engine.core.runner.dtype})")
    print(f"workload: {args.batch} requests of '{PROMPT}', {args.max_tokens} output tokens each, temperature 1")

    # Grammar compile time over the 200 schemas, cold.
    compiler = GrammarCompiler(tokenizer_info(model_dir / "tokenizer.json", facts.model_config.vocab_size,
                                              facts.eos_token_ids))
    compile_times = []
    for schema in schemas:
        start = time.perf_counter()
        compiler.compile(GrammarSpec("json", json.dumps(schema)))
        compile_times.append(time.perf_counter() - start)
    print(f"grammar compile over {len(schemas)} schemas (cold): p50 {_percentile(compile_times, 0.5) * 1e3:.1f} ms, "
          f"p99 {_percentile(compile_times, 0.99) * 1e3:.1f} ms")

    plain = [SamplingParams(seed=i, max_tokens=args.max_tokens, ignore_eos=True) for i in range(args.batch)]
    constrained = [
        SamplingParams(seed=i, max_tokens=args.max_tokens,
                       structured_outputs=StructuredOutputsParams(json=_wrapped(schemas[i % len(schemas)])))
        for i in range(args.batch)
    ]
    throughput_round(llm, constrained[:4] + plain[:4])  # warm up (and compile the batch's grammars once)
    throughput_round(llm, constrained)
    ratios, cpu_ratios, plain_rates = [], [], []
    for r in range(args.rounds):
        a, a_cpu = throughput_round(llm, plain)
        b, b_cpu = throughput_round(llm, constrained)
        ratios.append(b / a)
        plain_rates.append(a)
        cpu_ratios.append(b_cpu / a_cpu)
        print(f"round {r + 1}: unconstrained {a:.1f} tok/s ({a_cpu:.1f} per CPU-s), JSON schema {b:.1f} tok/s "
              f"({b_cpu:.1f} per CPU-s), ratio {b / a:.3f} wall, {b_cpu / a_cpu:.3f} CPU")
    for name, values in (("wall-clock", ratios), ("CPU-time", cpu_ratios)):
        median = statistics.median(values)
        print(f"JSON schema / unconstrained, {name} tok/s: median {median:.3f} (loss {100 * (1 - median):.1f}%), "
              f"range {min(values):.3f}-{max(values):.3f}")

    per_step = grammar_work_per_step(llm, [_wrapped(schemas[i % len(schemas)]) for i in range(args.batch)],
                                     args.max_tokens)
    print(f"grammar work per step of {args.batch} rows (masks filled + applied + grammars advanced): "
          f"{per_step * 1e3:.2f} ms, against a step of {args.batch / statistics.median(plain_rates) * 1e3:.0f} ms "
          f"(median unconstrained round): {100 * per_step * statistics.median(plain_rates) / args.batch:.1f}%")

    # TTFT of one request alone: unconstrained, with a cached grammar, with a grammar compiled cold.
    plain_ttft, warm_ttft, cold_ttft = [], [], []
    for i in range(args.ttft_repeats):
        plain_ttft.append(ttft(llm, SamplingParams(max_tokens=1)))
        warm = StructuredOutputsParams(json=_wrapped(schemas[0]))
        warm_ttft.append(ttft(llm, SamplingParams(max_tokens=1, structured_outputs=warm)))
        cold = StructuredOutputsParams(json=_wrapped(schemas[100 + i]))  # not compiled yet
        cold_ttft.append(ttft(llm, SamplingParams(max_tokens=1, structured_outputs=cold)))
    p, w, c = (statistics.median(x) * 1e3 for x in (plain_ttft, warm_ttft, cold_ttft))
    print(f"TTFT alone (median of {args.ttft_repeats}): unconstrained {p:.1f} ms, cached grammar {w:.1f} ms "
          f"(+{w - p:.1f}), grammar compiled cold {c:.1f} ms (+{c - p:.1f})")


if __name__ == "__main__":
    main()
