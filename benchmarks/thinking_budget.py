"""What a thinking budget costs: output tok/s of a batch whose replies reason under `thinking_budget` against the same
batch without one (same engine, alternating A/B rounds, the order reversed every round). Every reply runs exactly
max_tokens tokens (ignore_eos) and is reasoning from its first token (the prompt opened it), so the budgeted arm
decodes `--budget` tokens of reasoning, its forced end, then the rest: what changes is the engine's work, not the
token count. A budgeted sequence does not run a step ahead of its pending token near the budget's end, and does not
speculate until its section closes.

    python benchmarks/thinking_budget.py [--model DIR] [--batch 32] [--max-tokens 128] [--budget 48] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

from llmserve import LLM, SamplingParams
from llmserve.model.builtin import make_model
from llmserve.sampling.params import ThinkingBudgetParams

PROMPT = "Think it through, then answer: what is the weather like on Mars?"
END = [1000, 1001]  # two token ids standing for the reasoning's end tag


def throughput(llm: LLM, params: SamplingParams, batch: int) -> float:
    start = time.perf_counter()
    outputs = llm.generate([PROMPT] * batch, params)
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a checkpoint directory (default: the built-in small llama)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = args.model or str(make_model(Path(os.environ.get("TMPDIR", "/tmp")) / "llmserve-thinking-bench",
                                         "llama", "small", 0))
    llm = LLM(model, dtype="bfloat16", max_model_len=1024)
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    capped = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                            thinking_budget=ThinkingBudgetParams(args.budget, END))
    arms = {"no budget": plain, "budget": capped}
    throughput(llm, plain, args.batch)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in arms}
    for round_ in range(args.rounds):
        order = list(arms) if round_ % 2 == 0 else list(reversed(arms))
        for name in order:
            rates[name].append(throughput(llm, arms[name], args.batch))
    print(f"model {model}, bf16, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
          f"{args.batch} requests x {args.max_tokens} tokens, budget {args.budget}")
    for name, values in rates.items():
        print(f"{name:>10}: {statistics.median(values):8.1f} tok/s (rounds: {', '.join(f'{v:.1f}' for v in values)})")
    ratios = [b / a for a, b in zip(rates["no budget"], rates["budget"], strict=True)]
    print(f"budget / no budget per round: {', '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
