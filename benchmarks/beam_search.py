"""What beam search (`use_beam_search`) costs on CPU, against sampling the same number of choices and against
transformers' beam search, on the built-in `--size` Llama (random weights), alternated round by round.

One request: a --prompt-tokens random prompt, --width beams (or choices), --max-tokens out each (ignore_eos:
every beam runs to the end). Timed whole, as one `LLM.generate` call (transformers: one `generate` with
`num_beams`):
- `sampled`: n = width sampled choices in one request (one prefill, then the choices decode together);
- `beams`: beam search of that width, each step one one-token request per beam, the prefix cache holding the
  rest of every beam's prompt;
- `beams, no prefix cache`: the same with the prefix cache off (every step computes every beam's whole prompt);
- `transformers`: `generate(num_beams=width, num_return_sequences=width)`, its KV cache reordered each step.

    python benchmarks/beam_search.py [--size medium] [--rounds 3] [--width 4] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.model.builtin import make_model  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spec_decode import random_prompts  # noqa: E402


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="medium", choices=("tiny", "small", "medium"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / args.size, "llama", args.size, 0)
        options = dict(dtype="bfloat16", max_model_len=2048)
        cached = LLM(str(model_dir), **options)
        uncached = LLM(str(model_dir), enable_prefix_caching=False, **options)
        reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        vocab = reference.config.vocab_size
        width, max_tokens = args.width, args.max_tokens
        sampled = SamplingParams(n=width, temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
        beams = SamplingParams(n=width, temperature=0, max_tokens=max_tokens, ignore_eos=True, use_beam_search=True)

        def hf_beams(prompt: list[int]) -> None:
            with torch.inference_mode():
                reference.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                                   do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                   pad_token_id=0)

        times: dict[str, list[float]] = {}
        for round_ in range(args.rounds + 1):  # the first round warms everything up, unreported
            prompt = random_prompts(1, args.prompt_tokens, vocab, seed=round_)[0]
            systems = [
                ("sampled", lambda p=prompt: cached.generate([p], sampled)),
                ("beams", lambda p=prompt: cached.generate([p], beams)),
                ("beams, no prefix cache", lambda p=prompt: uncached.generate([p], beams)),
                ("transformers", lambda p=prompt: hf_beams(p)),
            ]
            for name, run in systems if round_ % 2 else systems[::-1]:
                elapsed = timed(run)
                if round_:
                    times.setdefault(name, []).append(elapsed)
            print(f"round {round_} done", flush=True)

    print(f"\nbuilt-in {args.size} Llama, bf16, random weights; {args.prompt_tokens} prompt tokens, width {width}, "
          f"{max_tokens} tokens out each; {os.cpu_count()} CPUs; medians of {args.rounds} rounds (seconds per "
          "request; ratio to `beams` per round: median (lowest-highest))")
    for name, values in times.items():
        ratios = [a / b for a, b in zip(values, times["beams"], strict=True)]
        print(f"{name:<24} {statistics.median(values):7.3f} s  {statistics.median(ratios):5.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
