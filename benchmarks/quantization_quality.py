"""How far int8 and fp8 weights move the built-in `medium` model's next-token distributions from bf16.

Over POSITIONS positions of held-out corpus text (llmserve.model.corpus with a seed the tokenizer was not
trained on, cut into sequences of SEQ_LEN tokens, each prefilled in one step), every variant's logits are
compared with the bf16 model's: per-token KL(bf16 || variant) and top-1 agreement, and the relative
error of the final hidden state (||h - h_bf16|| / ||h_bf16|| over all positions). Variants:
  - int8: per-channel int8 weights (`--quantization int8`, the CPU int8 kernel),
  - fp8: per-channel e4m3 weights (`--quantization fp8`); on CPU this runs as the product's weight-only
    emulation (weights converted per call), which is what decode-sized batches compute on GPUs too
    (`triton_linear`); on a GPU with fp8 tensor cores these prefill-sized steps take the W8A8 path
    (per-token e4m3 activations, `_scaled_mm`),
  - int8 / fp8 with the lm_head quantized too (`--quantize-lm-head`), also against int8 / fp8 alone: the same
    hidden states into the two heads, so the head's own share of the damage,
  - float32: the same checkpoint in float32, for scale: what bf16 itself costs against float32.
A quantized KV cache (--kv-cache-dtypes: int8 on CPU, fp8 on a GPU) changes nothing when a whole sequence is
prefilled in one step (a fresh prompt attends to its own keys), so those variants compute every position as a
decode step (the sequences side by side, one token each per step, teacher-forced), each reading its context
back from the cache, and are compared with the bf16 model decoding the same way with a bf16 cache.
The medium model has random weights (see llmserve.model.builtin), so these figures measure numerical
damage to a fixed function, not language-model quality.

    python benchmarks/quantization_quality.py --json bench_out/quantization_quality.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from llmserve.config import EngineConfig
from llmserve.model.builtin import ensure_default_model
from llmserve.model.config import ModelConfig
from llmserve.model.corpus import generate_corpus
from llmserve.model.runner import ModelRunner, StepBatch

HELD_OUT_SEED = 20261124  # the tokenizer is trained on seed 0's corpus


def corpus_sequences(model_dir: Path, positions: int, seq_len: int) -> list[list[int]]:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids: list[int] = []
    lines = iter(generate_corpus(num_lines=20_000, seed=HELD_OUT_SEED))
    while len(ids) < positions:
        ids += tokenizer.encode(next(lines) + "\n", add_special_tokens=False).ids
    return [ids[i : i + seq_len] for i in range(0, positions, seq_len)]


def build_runner(model_dir: Path, dtype: str, quantization: str | None, seq_len: int, sequences: int = 1,
                 kv_cache_dtype: str = "auto", quantize_lm_head: bool = False) -> ModelRunner:
    config = EngineConfig(model=str(model_dir), dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                          quantize_lm_head=quantize_lm_head, num_kv_blocks=sequences * -(-seq_len // 16) + 1,
                          block_size=16)
    return ModelRunner(config, ModelConfig.from_pretrained(model_dir), model_dir, max_model_len=seq_len)


@torch.inference_mode()
def sequence_outputs(runner: ModelRunner, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 final hidden states, float32 log-softmax of the logits) at every position of `ids`,
    prefilled in one step."""
    n = len(ids)
    batch = StepBatch(
        input_ids=np.array(ids, dtype=np.int64), num_computed=np.array([0]), num_new=np.array([n]),
        block_tables=[list(range(-(-n // runner.block_size)))], logits_rows=[], sampling_rows=[],
    )
    input_ids, positions, meta = runner.prepare_inputs(batch)
    runner.attn_backend.prepare(meta)
    hidden = runner.model(input_ids, positions, runner.kv_caches, runner.attn_backend, meta)
    return hidden.float(), torch.log_softmax(runner.model.compute_logits(hidden).float(), dim=-1)


@torch.inference_mode()
def decoded_outputs(runner: ModelRunner, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`all_outputs` with every position computed as a decode step on the path the engine takes (the one-call
    CPU decoder, CUDA graphs), the sequences side by side, so each position reads its context from the cache."""
    blocks_each = -(-max(map(len, sequences)) // runner.block_size)
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(len(sequences))]
    rows_of: list[list[torch.Tensor]] = [[] for _ in sequences]
    for position in range(max(map(len, sequences))):
        rows = [i for i, ids in enumerate(sequences) if position < len(ids)]
        batch = StepBatch(
            input_ids=np.array([sequences[i][position] for i in rows], dtype=np.int64),
            num_computed=np.full(len(rows), position), num_new=np.ones(len(rows), dtype=np.int64),
            block_tables=[tables[i] for i in rows], logits_rows=[], sampling_rows=[],
        )
        hidden = runner.forward(*runner.prepare_inputs(batch))
        for row, i in enumerate(rows):
            rows_of[i].append(hidden[row])
    hidden = torch.cat([torch.stack(rows) for rows in rows_of])
    return hidden.float(), torch.log_softmax(runner.model.compute_logits(hidden).float(), dim=-1)


def all_outputs(runner: ModelRunner, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    hidden, logprobs = zip(*(sequence_outputs(runner, s) for s in sequences), strict=True)
    return torch.cat(hidden), torch.cat(logprobs)


def compare(reference: tuple[torch.Tensor, torch.Tensor], variant: tuple[torch.Tensor, torch.Tensor]) -> dict:
    (ref_hidden, reference), (hidden, variant) = reference, variant
    kl = (reference.exp() * (reference - variant)).sum(dim=-1)
    return {
        "hidden_rel_err": ((hidden - ref_hidden).norm() / ref_hidden.norm()).item(),
        "kl_mean": kl.mean().item(),
        "kl_p99": kl.quantile(0.99).item(),
        "kl_max": kl.max().item(),
        "top1_agreement": (reference.argmax(-1) == variant.argmax(-1)).float().mean().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, default=2000)
    parser.add_argument("--seq-len", type=int, default=500)
    parser.add_argument("--kv-cache-dtypes", default="fp8" if torch.cuda.is_available() else "int8",
                        help="quantized KV caches to compare, decoded step by step (comma-separated; '' for none)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    model_dir = ensure_default_model("llama", "medium")
    sequences = corpus_sequences(model_dir, args.positions, args.seq_len)
    positions = sum(map(len, sequences))
    print(f"medium model, {positions} positions in {len(sequences)} sequences of <= {args.seq_len} tokens")
    start = time.perf_counter()
    reference = all_outputs(build_runner(model_dir, "bfloat16", None, args.seq_len), sequences)
    results, outputs = {}, {}
    on_hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
    fp8_name = "fp8 (W8A8: e4m3 activations, _scaled_mm)" if on_hopper else "fp8 (weight-only emulation)"
    for name, dtype, quantization, head in (
        ("int8", "bfloat16", "int8", False), ("int8, lm_head too", "bfloat16", "int8", True),
        (fp8_name, "bfloat16", "fp8", False), ("fp8, lm_head too", "bfloat16", "fp8", True),
        ("float32", "float32", None, False),
    ):
        runner = build_runner(model_dir, dtype, quantization, args.seq_len, quantize_lm_head=head)
        outputs[name] = all_outputs(runner, sequences)
        results[name] = compare(reference, outputs[name])
    for method in ("int8", "fp8"):  # the same hidden states into both heads: what quantizing the head alone costs
        body = next(name for name in outputs if name.startswith(method) and "lm_head" not in name)
        results[f"{method} lm_head alone (vs {method})"] = compare(outputs[body], outputs[f"{method}, lm_head too"])
    kv_dtypes = [name for name in args.kv_cache_dtypes.split(",") if name]
    if kv_dtypes:
        def decoded(kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
            runner = build_runner(model_dir, "bfloat16", None, args.seq_len, len(sequences), kv_cache_dtype)
            return decoded_outputs(runner, sequences)

        decoded_reference = decoded("auto")
        results["bf16 decode steps vs one-step prefill"] = compare(reference, decoded_reference)
        for kv_dtype in kv_dtypes:
            results[f"{kv_dtype} KV cache (decode steps)"] = compare(decoded_reference, decoded(kv_dtype))
    for name, r in results.items():
        print(f"{name if '(vs ' in name else name + ' vs bf16':>48}: KL mean {r['kl_mean']:.5f}  p99 {r['kl_p99']:.5f}  max {r['kl_max']:.4f}  "
              f"top-1 agreement {100 * r['top1_agreement']:.2f}%  final hidden rel. error {r['hidden_rel_err']:.3f}")
    print(f"({time.perf_counter() - start:.0f} s)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "model": "medium (llama, random weights)", "positions": positions, "seq_len": args.seq_len,
            "machine": platform.processor() or platform.machine(), "device": device,
            "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "torch": torch.__version__,
            "results": results,
        }, indent=2))


if __name__ == "__main__":
    main()
