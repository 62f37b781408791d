"""xgrammar vs llguidance for structured output, on the same JSON schemas and the built-in tokenizer.

Per backend: the time to compile each schema against the vocabulary (cold: a fresh compiler, no
cache), and the time to compute one token mask along a walk through the grammar. Both walk the same
token sequences: xgrammar's walk picks a seeded random allowed token each step, and llguidance
follows those tokens. Also the sampler's two ways to apply a packed mask to a batch of logits on
the CPU: unpacking with numpy and one add (what `llmserve.sampling.sampler` does) against xgrammar's CPU
kernel `apply_token_bitmask_inplace`.

    python benchmarks/grammar_backends.py [--size small] [--schemas 200] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import llguidance
import llguidance.torch as llg_torch
import numpy as np
import torch
import xgrammar as xgr

from llmserve.bench.json_schemas import generate_schemas
from llmserve.engine.grammar import GrammarSpec, build_grammar, tokenizer_info
from llmserve.model.builtin import EOS_TOKEN, make_model, special_token_ids
from llmserve.sampling.sampler import Sampler


def _percentiles(values: list[float]) -> str:
    values = sorted(values)
    p50 = values[len(values) // 2]
    p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
    return f"mean {statistics.fmean(values) * 1e3:8.3f} ms  p50 {p50 * 1e3:8.3f} ms  p99 {p99 * 1e3:8.3f} ms"


def bench_xgrammar(info: xgr.TokenizerInfo, schemas: list[str], steps: int,
                   seed: int) -> tuple[list[float], list[float], list[list[int]]]:
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compile_times, mask_times, walks = [], [], []
    rng = random.Random(seed)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    for schema in schemas:
        start = time.perf_counter()
        compiled = compiler.compile_grammar(build_grammar(GrammarSpec("json", schema)))
        compile_times.append(time.perf_counter() - start)
        matcher = xgr.GrammarMatcher(compiled)
        walk: list[int] = []
        for _ in range(steps):
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            mask_times.append(time.perf_counter() - start)
            allowed = _allowed(bitmask[0].numpy(), info.vocab_size)
            token = int(rng.choice(allowed))
            walk.append(token)
            if not matcher.accept_token(token) or matcher.is_terminated():
                break
        walks.append(walk)
    return compile_times, mask_times, walks


def bench_llguidance(tokenizer_json: str, vocab_size: int, eos: int, schemas: list[str],
                     walks: list[list[int]]) -> tuple[list[float], list[float]]:
    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
    compile_times, mask_times = [], []
    bitmask = llg_torch.allocate_token_bitmask(1, vocab_size)
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    for schema, walk in zip(schemas, walks, strict=True):
        start = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        compile_times.append(time.perf_counter() - start)
        for token in walk:
            start = time.perf_counter()
            llg_torch.fill_next_token_bitmask(matcher, bitmask, 0)
            mask_times.append(time.perf_counter() - start)
            if not matcher.consume_token(token):
                break
    return compile_times, mask_times


def _allowed(row: np.ndarray, vocab_size: int) -> np.ndarray:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)


def bench_apply(batch: int, vocab_size: int, repeats: int) -> tuple[float, float]:
    """Seconds per application of a [batch, vocab] mask: torch unpacking vs xgrammar's CPU kernel."""
    logits = torch.randn(batch, vocab_size)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (batch, (vocab_size + 31) // 32), dtype=torch.int32)
    rows = torch.arange(batch)
    sampler = Sampler()
    work = logits.clone()
    sampler._apply_token_bitmask_(work, rows, bitmask)
    reference = logits.clone()
    xgr.apply_token_bitmask_inplace(reference, bitmask, vocab_size=vocab_size)
    assert torch.equal(work, reference), "the two ways disagree"
    timings = []
    for apply in (lambda w: sampler._apply_token_bitmask_(w, rows, bitmask),
                  lambda w: xgr.apply_token_bitmask_inplace(w, bitmask, vocab_size=vocab_size)):
        best = float("inf")
        for _ in range(repeats):
            w = logits.clone()
            start = time.perf_counter()
            apply(w)
            best = min(best, time.perf_counter() - start)
        timings.append(best)
    return timings[0], timings[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--schemas", type=int, default=200)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp), "llama", args.size, 0)
        tokenizer_json = (model_dir / "tokenizer.json").read_text()
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        eos = special_token_ids(vocab_size)[EOS_TOKEN]
        start = time.perf_counter()
        info = tokenizer_info(model_dir / "tokenizer.json", vocab_size, [eos])
        info_time = time.perf_counter() - start
    schemas = [json.dumps(s) for s in generate_schemas(args.schemas, args.seed)]
    print(f"command: {' '.join(sys.argv)}")
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} torch thread(s), python {platform.python_version()}")
    print(f"workload: {len(schemas)} generated JSON schemas (seed {args.seed}), built-in {args.size} tokenizer "
          f"(vocab {vocab_size}), walks of up to {args.steps} tokens")
    print(f"xgrammar TokenizerInfo from tokenizer.json: {info_time * 1e3:.1f} ms")
    xc, xm, walks = bench_xgrammar(info, schemas, args.steps, args.seed)
    lc, lm = bench_llguidance(tokenizer_json, vocab_size, eos, schemas, walks)
    print(f"xgrammar   compile  {_percentiles(xc)}")
    print(f"llguidance compile  {_percentiles(lc)}")
    print(f"xgrammar   mask     {_percentiles(xm)}  ({len(xm)} masks)")
    print(f"llguidance mask     {_percentiles(lm)}  ({len(lm)} masks)")
    for batch, vocab in ((64, vocab_size), (64, 32000)):
        ours, theirs = bench_apply(batch, vocab, repeats=50)
        print(f"apply a [{batch}, {vocab}] mask on CPU: numpy unpack + add (the sampler) {ours * 1e3:.3f} ms, "
              f"xgrammar apply_token_bitmask_inplace {theirs * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
