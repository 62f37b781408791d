"""What the compiler makes of `triton_linear`'s one-row kernel for an H100/H200 (sm_90), on a machine without a
GPU: each tile's registers, the thread blocks an SM can hold with them, the loop's instructions per weight
byte, and the weight bytes a thread has asked for before its first floating-point instruction. Those
bytes, times the threads an SM holds, bound the loads an SM keeps in flight, and at batch 1 the kernel is
a stream of loads: on an H200 the bf16 tiles with ~64 KB an SM read at 95% of copy bandwidth where the
1-byte ones with 24-32 KB read at 67-72% (BENCHMARKS.md, issue 18). These are static figures to choose
what a GPU session sweeps, not timings.

    python benchmarks/gpu_sass.py                       # the defaults and gpu_linear.py's one-row sweep
    python benchmarks/gpu_sass.py --weights fp8 --tiles 8,1024,4,1,2,8 16,512,8 --json bench_out/sass.json

It compiles for real, so it runs without TRITON_INTERPRET (and refuses to start with it).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import astuple
from pathlib import Path
from typing import Any

REGISTERS_PER_SM = 65536
THREADS_PER_SM = 2048
BLOCKS_PER_SM = 32
TRITON_TYPES = {"bf16": "bf16", "fp8": "fp8e4nv", "int8": "i8"}
LOAD_BYTES = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}
FLOAT_OPS = ("FFMA", "FADD", "FMUL", "HADD2", "HFMA2", "F2FP", "I2F")
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", default="bf16,fp8,int8")
    ap.add_argument("--tiles", nargs="*", default=None,
                    help="TileConfig fields, comma-separated (block_n,block_k,warps[,stages,unroll,vector]); "
                         "default: triton_linear's one-row tiles and gpu_linear.py's one-row sweep")
    ap.add_argument("--pdl", action="store_true",
                    help="compile for programmatic dependent launch (llmserve.pdl): the first slice's loads come first")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("TRITON_INTERPRET is set: the kernels would be interpreted, not compiled")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    sys.path.insert(0, os.path.dirname(__file__))
    from gpu_linear import ONE_ROW_SWEEP

    from llmserve.model import triton_linear

    rows = []
    for kind in args.weights.split(","):
        width = 2 if kind == "bf16" else 1
        default = triton_linear._CONFIGS[("16-bit" if kind == "bf16" else kind, True)]
        tiles = [triton_linear.TileConfig(*map(int, t.split(","))) for t in args.tiles] if args.tiles is not None else [
            default, *(triton_linear.TileConfig(*c) for c in ONE_ROW_SWEEP[width])]
        for config in dict.fromkeys(tiles):
            row = {"weights": kind, "tiles": config, "default": config == default,
                   **loop_facts(compile_one_row(triton_linear.gemv_kernel, TRITON_TYPES[kind], config, args.pdl),
                                  config, width)}
            rows.append(row)
            print(format_row(row), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps([{**row, "tiles": astuple(row["tiles"])} for row in rows], indent=2))
    return rows


def compile_one_row(kernel, weight_type: str, config, pdl: bool = False) -> bytes:
    """The cubin of the one-row kernel for sm_90, specialized as a launch on the 8B shapes would be (every
    size a multiple of 16)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource


    pointers = {"x_ptr": "*bf16", "w_ptr": "*" + weight_type, "scale_ptr": "*fp32", "bias_ptr": "*bf16",
                "out_ptr": "*bf16", "norm_w_ptr": "*bf16", "residual_ptr": "*bf16", "residual_out_ptr": "*bf16",
                "eps": "fp32", "partial_ptr": "*fp32", "arrived_ptr": "*i32"}
    constants = dict(HAS_SCALE=weight_type != "bf16", HAS_BIAS=False, BLOCK_N=config.block_n,
                     BLOCK_K=config.block_k, UNROLL=config.unroll, VECTOR=config.vector, SWIGLU=False, NORM=False,
                     HAS_RESIDUAL=False, SPLIT_K=config.split_k, PDL=pdl)
    signature = {name: pointers.get(name, "constexpr" if name in constants else "i32") for name in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if name not in constants and signature[name] != "fp32"}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs=constants, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    return compiled.asm["cubin"]


def cuobjdump(cubin: bytes, flag: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def main_loop(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body: the K loop."""
    code = [(int(m.group(1), 16), m.group(2)) for m in SASS_LINE.finditer(sass)]
    index = {address: i for i, (address, _) in enumerate(code)}
    spans = []
    for i, (address, text) in enumerate(code):
        target = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address and int(target.group(1), 16) in index:
            spans.append((index[int(target.group(1), 16)], i))
    start, end = max(spans, key=lambda span: span[1] - span[0])
    return [text for _, text in code[start:end + 1]]


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def load_bytes(op: str) -> int:
    return LOAD_BYTES.get(op.split(".")[-1], 4)


def loop_facts(cubin: bytes, config, width: int) -> dict[str, Any]:
    body = main_loop(cuobjdump(cubin, "-sass"))
    registers = int(re.search(r"REG:(\d+)", cuobjdump(cubin, "-res-usage")).group(1))
    threads = 32 * config.num_warps
    first_float = next((i for i, text in enumerate(body) if opcode(text).split(".")[0] in FLOAT_OPS), len(body))
    early = sum(load_bytes(opcode(text)) for text in body[:first_float] if opcode(text).startswith("LDG"))
    blocks = min(REGISTERS_PER_SM // (threads * -(-registers // 8) * 8), THREADS_PER_SM // threads, BLOCKS_PER_SM)
    weight_bytes = config.block_n * config.block_k * config.unroll * width / threads
    ops = collections.Counter(opcode(text).split(".")[0] for text in body)
    return {"registers": registers, "blocks_per_sm": blocks, "loop_instructions": len(body),
            "instructions_per_byte": len(body) / weight_bytes, "weight_bytes_per_thread": weight_bytes,
            "bytes_before_first_float": early, "kb_in_flight_per_sm": blocks * threads * early / 1024,
            "barriers": ops["BAR"], "top_ops": dict(ops.most_common(6))}


def format_row(row: dict[str, Any]) -> str:
    c = row["tiles"]
    tiles = f"{c.block_n}x{c.block_k} w{c.num_warps} s{c.num_stages} u{c.unroll} v{c.vector}"
    return (f"{row['weights']:>4} {tiles:<26}{' (default)' if row['default'] else '          '} regs {row['registers']:>3}"
            f"  blocks/SM {row['blocks_per_sm']:>2}  instr/byte {row['instructions_per_byte']:4.2f}"
            f"  loaded before math {row['bytes_before_first_float']:>4.0f} of {row['weight_bytes_per_thread']:>4.0f} B"
            f"  in flight/SM {row['kb_in_flight_per_sm']:5.1f} KB  barriers {row['barriers']}")


if __name__ == "__main__":
    main()
