"""The C decode kernel for CPUs (csrc/paged_attention_cpu.c): built on first use, called via ctypes.

The build needs only a C compiler with OpenMP (gcc or clang); the shared object is cached under the
llmserve cache directory, keyed by the source, the flags and the machine. When no compiler is present or
the build fails, `load()` returns None and the torch backend keeps its pure-PyTorch path.
Set LLMSERVE_CPU_KERNELS=0 to turn the kernel off, =portable to keep it off the AVX-512 path (for
comparisons; `use_portable` does the same at run time).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c11"]
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def _cache_dir() -> Path:
    root = os.environ.get("LLMSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "llmserve"
    )
    return Path(root) / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


_portable_only = os.environ.get("LLMSERVE_CPU_KERNELS") == "portable"


def use_portable(portable: bool) -> None:
    """Send every later call to the portable C implementation (True) or to the best one built (False)."""
    global _portable_only
    _portable_only = portable


@functools.cache
def load() -> ctypes.CDLL | None:
    if os.environ.get("LLMSERVE_CPU_KERNELS", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        logger.info("no C compiler found: CPU decode attention uses the PyTorch path")
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([compiler, *FLAGS, platform.node(), platform.machine()]).encode())
    target = _cache_dir() / f"paged_attention_cpu-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as exc:
        logger.warning("building the CPU attention kernel failed (%s); using the PyTorch path", exc)
        return None
    for fn in (lib.llmserve_paged_decode, lib.llmserve_paged_decode_portable):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    return lib


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], check=True, capture_output=True)
        os.replace(built, target)  # atomic: a concurrent process sees the whole file or none


def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    return dtype in _DTYPE_CODES and num_heads // num_kv_heads <= 16 and head_dim <= 256


def paged_decode(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, portable: bool = False,
) -> torch.Tensor:
    """Attention of one query token per sequence ([B, H, D]) over its paged context. `portable` forces the
    plain-C implementation where the AVX-512 one would be used (for tests)."""
    lib = load()
    assert lib is not None, "call supports()/load() first"
    query = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    batch, heads, dim = query.shape
    _, kv_heads, block_size, _ = k_cache.shape
    fn = lib.llmserve_paged_decode_portable if portable or _portable_only else lib.llmserve_paged_decode
    status = fn(
        _DTYPE_CODES[query.dtype], query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        lens.data_ptr(), out.data_ptr(), batch, heads, kv_heads, dim, block_size, tables.shape[1], scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError("paged_decode kernel rejected its arguments")
    return out
