"""Linear layers for decode-sized batches on CPU: bf16 weights (csrc/linear_bf16_cpu.c) and int8 weights with
per-channel scales (csrc/linear_int8_cpu.c, `--quantization int8`).

A decode step multiplies a few rows of activations by every weight matrix, so its time is the time to
stream the weights from memory. oneDNN's bf16 GEMM (what `F.linear` runs) reaches a fraction of the
machine's read bandwidth at such shapes; the kernel reads each weight row once, front to back, and dots it
with every row of x while it is in cache. It runs where it was built with AVX512-BF16; on other CPUs its
plain-C implementation is slower than oneDNN and runs only when asked for (LLMSERVE_CPU_KERNELS=portable,
for tests and comparisons). Calls with more rows than `MAX_ROWS` (prefill, large batches) stay with
`F.linear`, which is faster there. The int8 kernel converts each int8 weight to bf16 on the fly (exactly)
and runs the same dot products, so it computes weight-only quantization's result while reading half the
bytes; `quantization.int8` calls it for up to `MAX_ROWS` rows.

LLMSERVE_CPU_KERNELS (see `llmserve.model.native`) turns the kernels off or keeps them on their portable
path; `use_kernel` (both kernels), `use_int8_kernel` and `use_portable` do the same at run time, for
comparisons in one process.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from llmserve.model import native

SOURCE = Path(__file__).with_name("csrc") / "linear_bf16_cpu.c"
INT8_SOURCE = Path(__file__).with_name("csrc") / "linear_int8_cpu.c"
# Above this oneDNN's blocked GEMM is as fast or faster, for bf16 weights and for int8 ones converted to bf16
# (see BENCHMARKS.md, issue 18).
MAX_ROWS = 8

_enabled = True
_int8_enabled = True
_portable_only = native.portable_from_env()


def use_kernel(enabled: bool) -> None:
    """Route later small-batch bf16 linears through the kernel (True) or always through F.linear (False)."""
    global _enabled
    _enabled = enabled


def use_int8_kernel(enabled: bool) -> None:
    """Route later small-batch int8 linears through the int8 kernel (True, if `use_kernel` allows) or through
    torch's int8 path (False), for comparisons."""
    global _int8_enabled
    _int8_enabled = enabled


def int8_kernel_enabled() -> bool:
    """False after `use_kernel(False)` or `use_int8_kernel(False)`."""
    return _enabled and _int8_enabled


def use_portable(portable: bool) -> None:
    """Send later kernel calls to the portable C implementation (True) or to the best one built (False)."""
    global _portable_only
    _portable_only = portable


def kernel_enabled() -> bool:
    """False after `use_kernel(False)`."""
    return _enabled


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, built on first use; None when it cannot be built or kernels are off."""
    lib = native.load_library(SOURCE)
    if lib is None:
        return None
    for fn in (lib.llmserve_linear_bf16, lib.llmserve_linear_bf16_portable):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5
    lib.llmserve_linear_bf16_has_avx512bf16.restype = ctypes.c_int
    return lib


@functools.cache
def has_fast_path() -> bool:
    """Whether the AVX512-BF16 implementation was compiled in (the machine has the instructions)."""
    lib = load()
    return lib is not None and bool(lib.llmserve_linear_bf16_has_avx512bf16())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the kernel when x is a few bf16 rows on the CPU."""
    if _enabled and _fits(x, weight) and (has_fast_path() or (_portable_only and load() is not None)):
        return bf16_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
        and x.dim() == 2 and x.shape[0] <= MAX_ROWS and weight.is_contiguous()
    )


def bf16_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, portable: bool = False
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) by the kernel, bf16 in and out; `portable` forces the plain-C
    implementation (for tests)."""
    lib = load()
    assert lib is not None, "call load() first"
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty((rows, n), dtype=torch.bfloat16)
    if bias is not None:
        bias = bias.contiguous()
    fn = lib.llmserve_linear_bf16_portable if portable or _portable_only else lib.llmserve_linear_bf16
    status = fn(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
                rows, n, k, max(x.stride(0), k), torch.get_num_threads())
    if status != 0:
        raise RuntimeError("linear_bf16 kernel rejected its arguments")
    return out


@functools.cache
def load_int8() -> ctypes.CDLL | None:
    """The int8 kernel library, built on first use; None when it cannot be built or kernels are off."""
    lib = native.load_library(INT8_SOURCE)
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for fn in (lib.llmserve_linear_int8, lib.llmserve_linear_int8_portable):
        fn.restype = ctypes.c_int
        fn.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.llmserve_linear_int8_has_avx512bf16.restype = ctypes.c_int
    return lib


@functools.cache
def int8_has_fast_path() -> bool:
    """Whether the int8 kernel's AVX512-BF16 implementation was compiled in."""
    lib = load_int8()
    return lib is not None and bool(lib.llmserve_linear_int8_has_avx512bf16())


def int8_kernel_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `int8_linear` should run x [M, K] against int8 `weight` [N, K]: few bf16 rows on the CPU, and
    the kernel built on its fast path (or the portable one asked for)."""
    return (
        _enabled and _int8_enabled and x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2
        and x.shape[0] <= MAX_ROWS and weight.dtype == torch.int8 and weight.is_contiguous()
        and (int8_has_fast_path() or (_portable_only and load_int8() is not None))
    )


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
    portable: bool = False,
) -> torch.Tensor:
    """x [M, K] bf16 @ (weight [N, K] int8 * scale [N] float32)^T (+ bias [N] bf16) by the int8 kernel, bf16
    out; `portable` forces the plain-C implementation (for tests)."""
    lib = load_int8()
    assert lib is not None, "call load_int8() first"
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty((rows, n), dtype=torch.bfloat16)
    scale = scale.float().contiguous()
    if bias is not None:
        bias = bias.to(torch.bfloat16).contiguous()
    fn = lib.llmserve_linear_int8_portable if portable or _portable_only else lib.llmserve_linear_int8
    status = fn(x.data_ptr(), rows, k, max(x.stride(0), k), weight.data_ptr(), scale.data_ptr(),
                None if bias is None else bias.data_ptr(), n, out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError("linear_int8 kernel rejected its arguments")
    return out
