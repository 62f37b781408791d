"""Shared pieces of the GPU benchmarks (`benchmarks/gpu_*.py`, run by `benchmarks/gpu.sh`).

Every script has a `--smoke` mode: the tiny built-in model on CPU with a handful of requests, so a CPU
test can run it end to end; the figures it prints then mean nothing.
"""

from __future__ import annotations

import json
import platform
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from llmserve.model.builtin import make_model

GB = 1e9


def bench_device(smoke: bool) -> torch.device:
    if smoke:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs CUDA (use --smoke for a CPU run of the script itself)")
    return torch.device("cuda")


def model_dir(path: str | None, smoke: bool, size_8b_dir: str = "bench_out/gpu/llama-3.1-8b") -> str:
    """The checkpoint to benchmark: `path`; for --smoke the tiny built-in model in a temporary directory;
    otherwise Llama-3.1-8B's config (no weights: the engine runs with load_format="dummy")."""
    if path:
        return path
    if smoke:
        return str(make_model(Path(tempfile.mkdtemp(prefix="llmserve-smoke-")), "llama", "tiny", 0))
    target = Path(size_8b_dir)
    if not (target / "config.json").is_file():
        make_model(target, "llama", "8b", with_weights=False)
    return str(target)


def engine_args(smoke: bool, **overrides: Any) -> dict[str, Any]:
    """EngineConfig fields for the benchmark: bfloat16 with dummy weights; --smoke: float32 on CPU."""
    args: dict[str, Any] = {"load_format": "dummy", "dtype": "bfloat16", "seed": 0}
    if smoke:
        args.update(device="cpu", dtype="float32", num_kv_blocks=256)
    args.update(overrides)
    return args


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth_gbs(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Device copy bandwidth: a large tensor copied onto another, 2 * bytes (read + write) / time."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    synchronize(device)
    elapsed = time.perf_counter() - start
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes * repeats / elapsed / GB


def random_prompts(num: int, lengths: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(rng.randint(*lengths))] for _ in range(num)]


def parse_range(text: str) -> tuple[int, int]:
    lo, hi = text.split(":")
    return int(lo), int(hi)


def machine_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"torch": torch.__version__, "cpu": platform.processor() or platform.machine()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / (1 << 30), 1),
                    cuda=torch.version.cuda)
    return info


def free_device_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def print_table(title: str, headers: list[str], rows: list[list[Any]]) -> None:
    print(f"\n{title}\n")
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2))
