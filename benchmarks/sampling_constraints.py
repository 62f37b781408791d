"""What vLLM's `allowed_token_ids` and `bad_words`, and the calls' grammar of strict functions under
`tool_choice: "auto"` (a structural tag: free text until a call opens), cost a decode step, against the same
requests without them, in one run, alternated round by round. Workload: the built-in model (offline `LLM`), `--batch`
greedy requests of `--tokens` tokens after a 4-token prompt; the per-step time is the whole `generate`
call (the per-request work included: tokenizing the bad words) over its tokens.

    python benchmarks/sampling_constraints.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from llmserve import LLM, SamplingParams
from llmserve.sampling.params import StructuredOutputsParams
from llmserve.server.tool_calls import HermesToolParser
from llmserve.server.tool_calls.strict import strict_calls_tag

PROMPT = "Once upon a time"
WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}


def variants(vocab_size: int) -> dict[str, dict]:
    return {
        "plain": {},
        "allowed_token_ids, the whole vocabulary": {"allowed_token_ids": list(range(vocab_size))},
        "allowed_token_ids, 100 ids": {"allowed_token_ids": list(range(100, 200))},
        "bad_words, 4 one-token words": {"bad_words": ["the", "and", "of", "to"]},
        "bad_words, 4 words, 2 of several tokens": {"bad_words": ["the", "and", "stomach", "fox"]},
        # the most the HTTP caps allow: 128 words, each under 128 tokens
        "bad_words, 128 words of 121 tokens": {"bad_words": [("a " * 120) + f"b{i}" for i in range(128)]},
        "repetition_penalty 1.1 (for scale)": {"repetition_penalty": 1.1},
        "strict tools under tool_choice auto": {"structured_outputs": StructuredOutputsParams(
            structural_tag=strict_calls_tag(HermesToolParser(), [WEATHER], parallel_tool_calls=True))},
    }


def ms_per_step(llm: LLM, extra: dict, batch: int, tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, **extra)
    start = time.perf_counter()
    llm.generate([PROMPT] * batch, params)
    return (time.perf_counter() - start) / tokens * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()

    llm = LLM()
    cases = variants(llm.engine.input_processor.vocab_size)
    for extra in cases.values():  # warm-up
        ms_per_step(llm, extra, args.batch, args.tokens)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, extra in cases.items():
            times[name].append(ms_per_step(llm, extra, args.batch, args.tokens))
    plain = statistics.median(times["plain"])
    print(f"built-in model, {args.batch} greedy requests x {args.tokens} tokens, {args.rounds} rounds, "
          f"{platform.processor() or platform.machine()}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:45s} {median:6.2f} ms a step (min {min(values):.2f})  {median / plain:.2f}x plain")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"batch": args.batch, "tokens": args.tokens, "ms_per_step": times}, out, indent=1)


if __name__ == "__main__":
    main()
