"""What n-gram speculative decoding (--speculative-config, vLLM's `ngram` method) gives and costs: the same
requests without and with it, alternated round by round, on two models of one shape:

  - `random`: the built-in random-weight Llama, whose output rarely repeats itself, so drafts are rarely
    right: the cost of verifying drafts that miss (the worst case);
  - `cycling`: the same checkpoint made to repeat cycles of 7 tokens (tests/cycling_model.py), as repetitive
    text does (code being edited, a quoted passage): drafts are mostly right, the best case. Greedy, and
    sampled at --temperature, where fewer drafts hold (its logits are sharp: at the default 90, about half).

Each workload is one `LLM.generate` call, timed whole: --batch prompts (1 and 16 by default) of 128 tokens,
--max-tokens out each (output tok/s; acceptance: accepted draft tokens / draft tokens).

    python benchmarks/spec_decode.py --size medium --rounds 3 [--k 4] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.model.builtin import make_model  # noqa: E402
from tests.cycling_model import make_cycling_model  # noqa: E402


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def timed_generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int, int]:
    """Output tok/s, and the draft tokens verified and accepted meanwhile."""
    before = llm.engine.core.stats().spec_decode
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    after = llm.engine.core.stats().spec_decode
    drafted = accepted = 0
    if after is not None and before is not None:
        drafted = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, drafted, accepted


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="medium", choices=("tiny", "small", "medium"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup", type=int, default=3, help="prompt_lookup_max (prompt_lookup_min is 1)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=90.0,
                    help="the sampled workload's: about half the cycling medium model's drafts hold at 90")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup,
            "prompt_lookup_min": 1}
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=7)
    with tempfile.TemporaryDirectory() as tmp:
        random_dir = make_model(Path(tmp) / "random", "llama", args.size, 0)
        cycling_dir = make_cycling_model(random_dir, Path(tmp) / "cycling")
        workloads = [("random", random_dir, "greedy", greedy), ("cycling", cycling_dir, "greedy", greedy),
                     ("cycling", cycling_dir, f"T={args.temperature}", sampled)]
        engines = {}
        for name, model_dir in (("random", random_dir), ("cycling", cycling_dir)):
            for label, config in (("plain", None), ("ngram", spec)):
                engines[name, label] = LLM(str(model_dir), dtype=args.dtype, speculative_config=config,
                                           max_num_seqs=max(max(args.batch), 8))
        vocab = engines["random", "plain"].engine.facts.model_config.vocab_size
        results: dict[tuple, list[tuple[float, int, int]]] = {}
        for llm in engines.values():  # warm-up: the kernels built, the first steps' allocations made
            timed_generate(llm, random_prompts(1, 128, vocab, seed=99), SamplingParams(max_tokens=8, ignore_eos=True))
        for round_ in range(args.rounds):
            for batch in args.batch:
                prompts = random_prompts(batch, 128, vocab, seed=batch)
                for model, _, sampling, params in workloads:
                    for label in ("plain", "ngram") if round_ % 2 == 0 else ("ngram", "plain"):  # ABBA
                        key = (batch, model, sampling, label)
                        results.setdefault(key, []).append(timed_generate(engines[model, label], prompts, params))
            print(f"round {round_ + 1} done", flush=True)
    print(f"\nllama {args.size} ({args.dtype}), 128-token prompts, {args.max_tokens} tokens out, ngram k={args.k}, "
          f"n-grams 1..{args.lookup}; {os.cpu_count()} CPUs; medians of {args.rounds} rounds (output tok/s); "
          "ratio: ngram / plain in each round, their median (lowest-highest)")
    print(f"{'batch':>5}  {'model':<8} {'sampling':<8} {'plain':>8} {'ngram':>8} {'ratio':>19} {'accepted':>9}")
    for batch in args.batch:
        for model, _, sampling, _ in workloads:
            plain_runs, runs = results[batch, model, sampling, "plain"], results[batch, model, sampling, "ngram"]
            ratios = [b[0] / a[0] for a, b in zip(plain_runs, runs, strict=True)]
            drafted, accepted = sum(r[1] for r in runs), sum(r[2] for r in runs)
            share = f"{accepted / drafted:.0%}" if drafted else "-"
            ratio = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
            print(f"{batch:>5}  {model:<8} {sampling:<8} {statistics.median(r[0] for r in plain_runs):8.1f} "
                  f"{statistics.median(r[0] for r in runs):8.1f} {ratio:>19} {share:>9}")


if __name__ == "__main__":
    main()
