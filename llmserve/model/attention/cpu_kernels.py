"""The C decode kernel for CPUs (csrc/paged_attention_cpu.c): built on first use by `llmserve.model.native`,
called via ctypes. When it cannot be built, `load()` returns None and the torch backend keeps its pure-PyTorch
path. LLMSERVE_CPU_KERNELS=0 turns it off, =portable keeps it off the AVX-512 path (for comparisons;
`use_portable` does the same at run time).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from llmserve.model import native

SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.c"
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_portable_only = native.portable_from_env()


def use_portable(portable: bool) -> None:
    """Send every later call to the portable C implementation (True) or to the best one built (False)."""
    global _portable_only
    _portable_only = portable


@functools.cache
def load(defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The kernel library, built on first use; None when it cannot be built or kernels are off. `defines`
    builds a variant of its tuning constants (NAME=VALUE), for benchmarks and tests."""
    lib = native.load_library(SOURCE, defines=defines)
    if lib is None:
        return None
    for fn in (lib.llmserve_paged_decode, lib.llmserve_paged_decode_portable):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int]
    return lib


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
