"""Engine parity in float32 on one machine: the torch attention backend (eager), the triton backend
(eager), the triton backend with CUDA graphs, and that again with programmatic dependent launch
(`llmserve.pdl`) must produce identical greedy outputs.

The model is the built-in `small` checkpoint (random weights, clear logit margins), so a difference
means a bug, not rounding. Exit status 1 when any configuration differs from the first.

    python benchmarks/gpu_parity.py --json bench_out/gpu/parity.json
    python benchmarks/gpu_parity.py --smoke       # CPU, tiny model, the torch backend twice
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

from gpu_common import bench_device, free_device_memory, machine_info, print_table, random_prompts, write_json

from llmserve import LLM, SamplingParams, pdl
from llmserve.model.builtin import make_model

# (backend, enforce_eager, programmatic dependent launch)
CUDA_CONFIGS = [("torch", True, False), ("triton", True, False), ("triton", False, False), ("triton", False, True)]
SMOKE_CONFIGS = [("torch", True, False), ("torch", True, False)]


def generate(path: str, backend: str, eager: bool, use_pdl: bool, prompts: list[list[int]], max_tokens: list[int],
             smoke: bool) -> tuple[list[list[int]], bool]:
    extra: dict[str, Any] = {"device": "cpu", "num_kv_blocks": 256} if smoke else {"gpu_memory_utilization": 0.5}
    setting, pdl.enabled = pdl.enabled, use_pdl  # read at each launch, so also by the graphs captured at start
    try:
        llm = LLM(path, dtype="float32", attention_backend=backend, enforce_eager=eager, max_model_len=1024,
                  max_num_seqs=32, **extra)
        graphs = llm.engine.core.runner.graphs is not None
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        outputs = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
        del llm
    finally:
        pdl.enabled = setting
    return outputs, graphs


def first_difference(a: list[list[int]], b: list[list[int]]) -> str:
    for index, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            position = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
            return f"request {index}, token {position}"
    return "-"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: built-in llama small)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.num_prompts, args.max_tokens = 4, 6

    device = bench_device(args.smoke)
    size = "tiny" if args.smoke else "small"
    path = args.model or str(make_model(Path(tempfile.mkdtemp(prefix="llmserve-parity-")), "llama", size, 0))
    vocab = 1024 if args.smoke else 8192
    prompts = random_prompts(args.num_prompts, (4, 400 if not args.smoke else 20), vocab, seed=2)
    max_tokens = [args.max_tokens - (i % 7) for i in range(args.num_prompts)]
    configs = SMOKE_CONFIGS if args.smoke else CUDA_CONFIGS
    runs = []
    reference: list[list[int]] | None = None
    for backend, eager, use_pdl in configs:
        try:
            outputs, graphs = generate(path, backend, eager, use_pdl, prompts, max_tokens, args.smoke)
        except ValueError as exc:  # e.g. the triton backend is not registered
            runs.append({"backend": backend, "cuda_graphs": False, "pdl": use_pdl, "identical": 0,
                         "requests": len(prompts), "first_difference": f"did not run: {exc}"})
            continue
        finally:
            free_device_memory(device)
        reference = reference if reference is not None else outputs
        same = sum(x == y for x, y in zip(outputs, reference, strict=True))
        runs.append({"backend": backend, "cuda_graphs": graphs, "pdl": use_pdl, "identical": same,
                     "requests": len(outputs), "first_difference": first_difference(reference, outputs)})
    result = {"model": path, "machine": machine_info(device), "args": vars(args), "runs": runs,
              "passed": all(r["identical"] == r["requests"] for r in runs)}
    print_table(
        f"float32 greedy parity ({args.num_prompts} requests, up to {args.max_tokens} tokens; reference: first row)",
        ["attention backend", "CUDA graphs", "PDL", "identical outputs", "first difference"],
        [[r["backend"], "yes" if r["cuda_graphs"] else "no", "yes" if r["pdl"] else "no",
          f"{r['identical']}/{r['requests']}", r["first_difference"]] for r in runs],
    )
    print(f"\nparity: {'passed' if result['passed'] else 'FAILED'}")
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
