"""The C decode kernel for CPUs (csrc/paged_attention_cpu.c): built on first use by `llmserve.model.native`,
called via ctypes. It reads float32 and bf16 caches, and the int8 cache of `int8_kv` under bf16 queries. When it cannot be built, `load()` returns None and the torch backend keeps its pure-PyTorch
path. LLMSERVE_CPU_KERNELS=0 turns it off, =portable keeps it off the AVX-512 path (for comparisons;
`use_portable` does the same at run time).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from llmserve.model import native
from llmserve.model.attention import int8_kv

SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.c"
# the C source's cache formats: queries and cache of one dtype, or bf16 queries over an int8 cache (int8_kv)
_FORMATS = {torch.float32: 0, torch.bfloat16: 1}
KV_INT8 = 2

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


def supports(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: torch.dtype | None = None
) -> bool:
    """Whether the kernel takes queries of `dtype` over a cache of `kv_cache_dtype` (default: the same)."""
    if kv_cache_dtype == torch.int8:
        fits_cache = dtype == torch.bfloat16 and head_dim % 2 == 0
    else:
        fits_cache = dtype in _FORMATS and kv_cache_dtype in (None, dtype)
    return fits_cache and num_heads // num_kv_heads <= 16 and head_dim <= 256


def format_code(dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> int:
    """The C source's code for queries of `dtype` over a cache of `kv_cache_dtype`."""
    return KV_INT8 if kv_cache_dtype == torch.int8 else _FORMATS[dtype]


def _block_size(k_cache: torch.Tensor, head_dim: int) -> int:
    return int8_kv.block_size_of(k_cache, head_dim) if k_cache.dtype == torch.int8 else k_cache.shape[2]


def paged_decode(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, portable: bool = False,
) -> torch.Tensor:
    """Attention of one query token per sequence ([B, H, D]) over its paged context, the caches in the torch
    backend's layout (`kv_cache_shape`). `portable` forces the plain-C implementation where the AVX-512 one
    would be used (for tests)."""
    lib = load()
    assert lib is not None, "call supports()/load() first"
    query = query.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    batch, heads, dim = query.shape
    kv_heads, block_size = k_cache.shape[1], _block_size(k_cache, dim)
    fn = lib.llmserve_paged_decode_portable if portable or _portable_only else lib.llmserve_paged_decode
    status = fn(
        format_code(query.dtype, k_cache.dtype), query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        lens.data_ptr(), out.data_ptr(), batch, heads, kv_heads, dim, block_size, tables.shape[1], scale,
        torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError("paged_decode kernel rejected its arguments")
    return out
