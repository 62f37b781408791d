"""Mixture-of-experts decoding on CPU: llmserve against transformers on the same random checkpoint, bf16,
alternated round by round. `--architecture qwen3-moe`: a scaled-down Qwen3-30B-A3B (8 layers of 1024, 32 experts of
512 features, 4 a token; 0.5B parameters, 0.12B active a token); `qwen2-moe`: a scaled-down Qwen1.5-MoE-A2.7B (the
same experts, not renormalised, and a shared expert of 2048 features; 0.55B parameters, 0.17B active a token).

Workloads: batch-1 decode (--prompt-tokens in, --max-tokens out, greedy: output tok/s over the whole call) and
--batch sequences decoding together (output tok/s). llmserve runs bf16, and with its weights (experts and
attention) quantized to int8 at load; transformers runs `generate` with its dynamic cache.

    python benchmarks/moe.py [--architecture qwen3-moe|qwen2-moe] [--rounds 3] [--batch 16] [--max-tokens 64]
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

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.model.builtin import make_model  # noqa: E402

_COMMON = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
               intermediate_size=2816, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
               vocab_size=32000, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
# architecture -> (transformers config class, its shape)
SHAPES = {
    "qwen3-moe": ("Qwen3MoeConfig", {**_COMMON, "norm_topk_prob": True}),
    "qwen2-moe": ("Qwen2MoeConfig", {**_COMMON, "norm_topk_prob": False, "shared_expert_intermediate_size": 2048}),
}


def build_checkpoint(out: Path, architecture: str) -> Path:
    """The random checkpoint in bf16, written by transformers, with the built-in medium model's tokenizer."""
    import transformers

    config_class, shape = SHAPES[architecture]
    tokenizer_dir = make_model(out.with_name("tokenizer"), "llama", "medium", 0, with_weights=False)
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**shape)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.02 if "embed" not in name else 1.0)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / name).write_bytes((tokenizer_dir / name).read_bytes())
    return out


def llmserve_tok_s(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def transformers_tok_s(model, prompts: list[list[int]], max_tokens: int) -> float:
    input_ids = torch.tensor(prompts)  # all of one length: no padding
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return (out.shape[1] - input_ids.shape[1]) * len(prompts) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--architecture", choices=sorted(SHAPES), default="qwen3-moe")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    import transformers

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_checkpoint(Path(tmp) / args.architecture, args.architecture)
        llm = LLM(str(model_dir), dtype="bfloat16", max_model_len=1024)
        int8 = LLM(str(model_dir), dtype="bfloat16", max_model_len=1024, quantization="int8")
        reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        workloads = {"batch 1": 1, f"batch {args.batch}": args.batch}
        results: dict[tuple[str, str], list[float]] = {}
        for round_ in range(args.rounds + 1):  # the first round warms both up, unreported
            for name, batch in workloads.items():
                prompts = [[rng.randrange(3, 32000) for _ in range(args.prompt_tokens)] for _ in range(batch)]
                systems = [("llmserve", lambda p=prompts: llmserve_tok_s(llm, p, args.max_tokens)),
                           ("llmserve int8", lambda p=prompts: llmserve_tok_s(int8, p, args.max_tokens)),
                           ("transformers", lambda p=prompts: transformers_tok_s(reference, p, args.max_tokens))]
                for system, run in systems if round_ % 2 else systems[::-1]:
                    tok_s = run()
                    if round_:
                        results.setdefault((name, system), []).append(tok_s)
            print(f"round {round_} done", flush=True)
    print(f"\n{args.architecture}, random weights, bf16: {SHAPES[args.architecture][1]}; {args.prompt_tokens} tokens in, {args.max_tokens} out, greedy; "
          f"{os.cpu_count()} CPUs; medians of {args.rounds} rounds (output tok/s); ratio llmserve / transformers "
          "per round: median (lowest-highest)")
    for name in workloads:
        theirs = results[name, "transformers"]
        for system in ("llmserve", "llmserve int8"):
            ours = results[name, system]
            ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
            print(f"{name:>9}: {system:<13} {statistics.median(ours):7.1f}  transformers {statistics.median(theirs):7.1f}"
                  f"  {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
