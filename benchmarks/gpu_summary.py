"""The short table `benchmarks/gpu.sh` prints last: each step's status and each goal, from the JSON
files the benchmark scripts wrote into OUT_DIR (and OUT_DIR/steps.tsv: name, exit status, seconds).

    python benchmarks/gpu_summary.py bench_out/gpu
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from gpu_common import print_table

OFFLINE_GOAL_TOK_S = 1.2 * 7784  # issue 12: offline throughput on one H100 before the engine-core split


def _load(out_dir: Path, name: str) -> dict[str, Any] | None:
    path = out_dir / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _status(met: bool) -> str:
    return "met" if met else "NOT met"


def goal_rows(out_dir: Path) -> list[list[str]]:
    rows = []
    parity = _load(out_dir, "parity")
    if parity:
        rows.append(["float32 parity: torch / triton / triton + graphs", "identical greedy outputs",
                     "all identical" if parity["passed"] else "differences", _status(parity["passed"])])
    decode = _load(out_dir, "decode")
    if decode:
        bf16 = [r for r in decode["runs"] if r.get("variant", "bf16") == "bf16"] or decode["runs"]
        best = max(bf16, key=lambda r: r["pct_of_copy_bw"])
        rows.append([f"batch-1 decode, bf16 ({best['mode']}): {best['tok_s']:.0f} tok/s, {best['achieved_gbs']:.0f} GB/s",
                     f">= {decode['goal']['pct_of_copy_bw']:.0f}% of copy bandwidth", f"{best['pct_of_copy_bw']:.0f}% of {decode['copy_gbs']:.0f} GB/s",
                     _status(decode["goal"]["met"])])
        rows += quantized_decode_rows(decode["runs"])
    throughput = _load(out_dir, "throughput")
    if throughput and "goal" in throughput:
        ours, hf = throughput["llmserve"], throughput["transformers_static"]
        rows.append([f"offline throughput: {ours['output_tok_s']:.0f} vs {hf['output_tok_s']:.0f} output tok/s",
                     ">= 10x transformers static batches", f"{throughput['goal']['measured']:.1f}x",
                     _status(throughput["goal"]["met"])])
    serving = _load(out_dir, "serving")
    if serving:
        median = serving["median"]
        rows.append([f"server {median['server_output_tok_s']:.0f} tok/s, offline {median['offline_output_tok_s']:.0f}",
                     ">= 95% of offline", f"{median['server_over_offline']:.1%}",
                     _status(median["server_over_offline"] >= 0.95)])
        rows.append([f"offline LLM.generate on the serving workload: {median['offline_output_tok_s']:.0f} tok/s",
                     f">= 1.2x 7,784 tok/s (H100, before issue 12) = {OFFLINE_GOAL_TOK_S:,.0f}",
                     f"{median['offline_output_tok_s'] / 7784:.2f}x",
                     _status(median["offline_output_tok_s"] >= OFFLINE_GOAL_TOK_S)])
    for name in ("serving", "serving-8rps"):
        run = _load(out_dir, name)
        if run:
            ratio = run["median"]["itl_over_tpot"]
            rows.append([f"{name}: ITL p50 / TPOT p50", "<= 1.1", f"{ratio:.2f}", _status(ratio <= 1.1)])
    overhead = _load(out_dir, "overhead")
    if overhead:
        run = next(r for r in overhead["runs"] if r["async_scheduling"])
        rows.append([f"host work at batch {run['batch']}, overlapped: {run['step_ms']:.1f} ms/step",
                     "host not hidden < 10% of step", f"{overhead['goal']['measured']:.1f}%",
                     _status(overhead["goal"]["met"])])
    return rows


def quantized_decode_rows(runs: list[dict]) -> list[list[str]]:
    """fp8 weights against bf16 (batch-1 tok/s), and the fp8 KV cache's pool against bf16's, when measured."""
    graphs = {r.get("variant"): r for r in runs if r["mode"] == "graphs"}
    rows = []
    bf16, fp8kv = graphs.get("bf16"), graphs.get("bf16-fp8kv")
    for variant, what in (("fp8", "fp8 weights"), ("fp8-head", "fp8 weights and lm_head"),
                          ("fp8-nopdl", "fp8 weights, no PDL"), ("fp8-head-nopdl", "fp8 weights and lm_head, no PDL")):
        fp8 = graphs.get(variant)
        baseline = graphs.get("bf16-nopdl" if variant.endswith("-nopdl") else "bf16")  # like with like
        if baseline and fp8:
            ratio = fp8["tok_s"] / baseline["tok_s"]
            rows.append([f"batch-1 decode, {what}: {fp8['tok_s']:.0f} tok/s against bf16's {baseline['tok_s']:.0f}",
                         ">= 1.7x bf16", f"{ratio:.2f}x", _status(ratio >= 1.7)])
    if bf16 and fp8kv:
        ratio = fp8kv["kv_pool_tokens"] / bf16["kv_pool_tokens"]
        rows.append([f"fp8 KV cache: {fp8kv['kv_pool_tokens']:,} tokens against bf16's {bf16['kv_pool_tokens']:,}",
                     "2x the tokens", f"{ratio:.2f}x", _status(ratio >= 1.99)])
    return rows


def step_rows(out_dir: Path) -> list[list[str]]:
    path = out_dir / "steps.tsv"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        name, rc, seconds = line.split("\t")
        status = {"0": "ok", "missing": "MISSING"}.get(rc, f"FAILED (exit {rc})")
        rows.append([name, status, seconds])
    return rows


def main(argv: list[str] | None = None) -> int:
    out_dir = Path((argv if argv is not None else sys.argv[1:])[0])
    steps = step_rows(out_dir)
    if steps:
        print_table("Steps", ["step", "status", "seconds"], steps)
    print_table("Goals", ["measurement", "goal", "result", "status"], goal_rows(out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
