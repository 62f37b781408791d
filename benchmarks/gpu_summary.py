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
        best = max(decode["runs"], key=lambda r: r["pct_of_copy_bw"])
        rows.append([f"batch-1 decode ({best['mode']}): {best['tok_s']:.0f} tok/s, {best['achieved_gbs']:.0f} GB/s",
                     ">= 80% of copy bandwidth", f"{best['pct_of_copy_bw']:.0f}% of {decode['copy_gbs']:.0f} GB/s",
                     _status(decode["goal"]["met"])])
    throughput = _load(out_dir, "throughput")
    if throughput and "goal" in throughput:
        ours, hf = throughput["llmserve"], throughput["transformers_static"]
        rows.append([f"offline throughput: {ours['output_tok_s']:.0f} vs {hf['output_tok_s']:.0f} output tok/s",
                     ">= 10x transformers static batches", f"{throughput['goal']['measured']:.1f}x",
                     _status(throughput["goal"]["met"])])
    overhead = _load(out_dir, "overhead")
    if overhead:
        run = next(r for r in overhead["runs"] if r["async_scheduling"])
        rows.append([f"host work at batch {run['batch']}, overlapped: {run['step_ms']:.1f} ms/step",
                     "host not hidden < 10% of step", f"{overhead['goal']['measured']:.1f}%",
                     _status(overhead["goal"]["met"])])
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
