"""What a predicted output (OpenAI's `prediction`) gives and costs: the same greedy request without one and with
one, alternated round by round, at batch 1. The prediction is given as token ids (`prediction_token_ids`, what
the server hands the engine after tokenizing the text):

  - `same`: the output itself (an edit that changes nothing): every draft holds, the best case;
  - `edited`: the output with 5 other tokens put in a tenth of the way in and one token in ten dropped after
    (a file with a few edits): drafts hold until an edit, then the place is found again;
  - `unrelated`: tokens the output has none of: nothing is drafted, the cost of looking.

Two models of one shape: `random` (the built-in random-weight Llama, run in float32: its logits are so flat that
in bfloat16 a step verifying drafts, which computes several positions in one matrix product, rounds differently
enough to flip near ties, as any speculative decoding would) and `cycling` (the same checkpoint made to repeat
cycles of 7 tokens, tests/cycling_model.py, whose logits are sharp: run in bfloat16, the serving dtype). `same
tokens` says how much of each run's output is the baseline's.

    python benchmarks/predicted_outputs.py --size small --max-tokens 256 --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.model.builtin import make_model  # noqa: E402
from tests.cycling_model import make_cycling_model  # noqa: E402

PROMPT = [5, 17, 42, 99, 7, 64, 128, 33]


def predictions(tokens: list[int], vocab: int) -> dict[str, list[int]]:
    tenth = max(1, len(tokens) // 10)
    inserted = [(t * 7 + 3) % vocab for t in tokens[:5]]
    edited = tokens[:tenth] + inserted + [t for i, t in enumerate(tokens[tenth:]) if i % 10 != 5]
    unseen = sorted(set(range(3, vocab)) - set(tokens))
    return {"same": tokens, "edited": edited, "unrelated": unseen[: len(tokens)]}


def timed(llm: LLM, params: SamplingParams) -> tuple[float, list[int], int, int]:
    """Seconds, the output's tokens, and the prediction's tokens taken and not."""
    start = time.perf_counter()
    output = llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0]
    return (time.perf_counter() - start, output.token_ids, output.accepted_prediction_tokens,
            output.rejected_prediction_tokens)


def run(model_dir: Path, label: str, dtype: str, max_tokens: int, rounds: int) -> None:
    llm = LLM(model=str(model_dir), dtype=dtype)
    base = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": PROMPT}], base)  # warm-up
    _, tokens, _, _ = timed(llm, base)
    cases = predictions(tokens, llm.engine.input_processor.vocab_size)
    times: dict[str, list[float]] = {"none": [], **{name: [] for name in cases}}
    taken: dict[str, tuple[int, int]] = {}
    agreed: dict[str, int] = {}
    for _ in range(rounds):
        for name in times:
            params = base if name == "none" else dataclasses.replace(base, prediction_token_ids=cases[name])
            seconds, output, accepted, rejected = timed(llm, params)
            same = next((i for i, (a, b) in enumerate(zip(output, tokens, strict=True)) if a != b), len(tokens))
            agreed[name] = min(agreed.get(name, same), same)
            times[name].append(seconds)
            taken[name] = (accepted, rejected)
    plain = statistics.median(times["none"])
    print(f"\n{label} {dtype}: {max_tokens} tokens greedy, batch 1, median of {rounds} rounds")
    print(f"{'prediction':<10} {'tok/s':>8} {'speedup':>8} {'taken':>6} {'not':>5} {'same tokens':>12}")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        accepted, rejected = taken.get(name, (0, 0))
        print(f"{name:<10} {max_tokens / median:8.1f} {plain / median:7.2f}x {accepted:6d} {rejected:5d} "
              f"{agreed[name]:>5d}/{len(tokens)}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=("tiny", "small", "medium"))
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        random_dir = make_model(Path(tmp) / "random", "llama", args.size, 0)
        run(random_dir, f"llama {args.size} random", "float32", args.max_tokens, args.rounds)
        cycling_dir = make_cycling_model(random_dir, Path(tmp) / "cycling")
        run(cycling_dir, f"llama {args.size} cycling", "bfloat16", args.max_tokens, args.rounds)


if __name__ == "__main__":
    main()
