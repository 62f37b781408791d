"""What speculative decoding with a draft model (--speculative-config '{"model": ...}', vLLM's `draft_model`)
gives and costs on CPU, by how often the draft is right: the same requests without a draft and with each of
three, alternated round by round.

No trained model pair can be had here, so agreement is built: the served model is the built-in `--size`
Llama made to repeat cycles of 7 tokens (tests/cycling_model.py), and each draft is a model of the `small`
shape (4 layers of 256) with the served model's vocabulary and tokenizer, made to cycle the same way with
`agreement` of its tokens' successors right and the rest random (1.0: every draft holds as long as the
served model follows its cycle; 0.7: about a fair 1B-for-8B pair's acceptance; 0.0: a draft that is never
right, the worst case: its cost without return).

Each workload is one `LLM.generate` call, timed whole: --batch prompts (1 and 8 by default) of 128 random
tokens, --max-tokens out each, greedy (output tok/s; acceptance: accepted draft tokens / draft tokens).

    python benchmarks/draft_model.py --size medium --rounds 3 [--k 4] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.model.builtin import DEFAULT_SHARD_SIZE, SIZES, make_model, write_weights  # noqa: E402
from tests.cycling_model import make_cycling_model  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from spec_decode import random_prompts, timed_generate  # noqa: E402

DRAFT_SHAPE = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size")
AGREEMENTS = (1.0, 0.7, 0.0)


def draft_checkpoint(target_dir: Path, dst: Path, agreement: float) -> Path:
    """A `small`-shaped Llama with the target's vocabulary and tokenizer, cycling with `agreement`."""
    random_dir = dst.with_name(dst.name + "-random")
    random_dir.mkdir(parents=True)
    config = json.loads((target_dir / "config.json").read_text())
    config.update({key: SIZES["small"][key] for key in DRAFT_SHAPE})
    for path in target_dir.iterdir():
        if path.suffix == ".json" and not path.name.startswith("model.safetensors"):
            shutil.copy(path, random_dir / path.name)
    (random_dir / "config.json").write_text(json.dumps(config))
    write_weights(random_dir, config, seed=1, shard_size=DEFAULT_SHARD_SIZE)
    return make_cycling_model(random_dir, dst, agreement=agreement, seed=2)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="medium", choices=("small", "medium"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    labels = ["plain"] + [f"draft {agreement:.1f}" for agreement in AGREEMENTS]
    with tempfile.TemporaryDirectory() as tmp:
        target_dir = make_cycling_model(make_model(Path(tmp) / "random", "llama", args.size, 0), Path(tmp) / "target")
        configs: dict[str, dict | None] = {"plain": None}
        for agreement, label in zip(AGREEMENTS, labels[1:], strict=True):
            draft_dir = draft_checkpoint(target_dir, Path(tmp) / f"draft-{agreement}", agreement)
            configs[label] = {"model": str(draft_dir), "num_speculative_tokens": args.k}
        engines = {label: LLM(str(target_dir), dtype=args.dtype, speculative_config=config,
                              max_num_seqs=max(max(args.batch), 8)) for label, config in configs.items()}
        vocab = engines["plain"].engine.facts.model_config.vocab_size
        for llm in engines.values():  # warm-up: the kernels built, the first steps' allocations made
            timed_generate(llm, random_prompts(1, 128, vocab, seed=99), SamplingParams(max_tokens=8, ignore_eos=True))
        results: dict[tuple, list[tuple[float, int, int]]] = {}
        for round_ in range(args.rounds):
            for batch in args.batch:
                prompts = random_prompts(batch, 128, vocab, seed=batch)
                for label in labels if round_ % 2 == 0 else labels[::-1]:
                    results.setdefault((batch, label), []).append(timed_generate(engines[label], prompts, greedy))
            print(f"round {round_ + 1} done", flush=True)
    print(f"\ncycling llama {args.size} ({args.dtype}) drafted by a small-shaped cycling llama (4 layers of 256, the "
          f"same vocabulary) right on a share of its tokens; 128-token prompts, {args.max_tokens} tokens out, greedy, "
          f"k={args.k}; {os.cpu_count()} CPUs; medians of {args.rounds} rounds (output tok/s); ratio: against plain "
          "in each round, their median (lowest-highest)")
    print(f"{'batch':>5}  {'engine':<10} {'tok/s':>8} {'ratio':>19} {'accepted':>9}")
    for batch in args.batch:
        plain_runs = results[batch, "plain"]
        for label in labels:
            runs = results[batch, label]
            ratios = [b[0] / a[0] for a, b in zip(plain_runs, runs, strict=True)]
            drafted, accepted = sum(r[1] for r in runs), sum(r[2] for r in runs)
            share = f"{accepted / drafted:.0%}" if drafted else "-"
            ratio = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
            print(f"{batch:>5}  {label:<10} {statistics.median(r[0] for r in runs):8.1f} {ratio:>19} {share:>9}")


if __name__ == "__main__":
    main()
