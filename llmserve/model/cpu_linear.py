"""bf16 linear layers for decode-sized batches on CPU: the C kernel csrc/linear_bf16_cpu.c.

A decode step multiplies a few rows of activations by every weight matrix, so its time is the time to
stream the weights from memory. oneDNN's bf16 GEMM (what `F.linear` runs) reaches a fraction of the
machine's read bandwidth at such shapes; the kernel reads each weight row once, front to back, and dots it
with every row of x while it is in cache. It runs where it was built with AVX512-BF16; on other CPUs its
plain-C implementation is slower than oneDNN and runs only when asked for (LLMSERVE_CPU_KERNELS=portable,
for tests and comparisons). Calls with more rows than `MAX_ROWS` (prefill, large batches) stay with
`F.linear`, which is faster there.

LLMSERVE_CPU_KERNELS (see `llmserve.model.native`) turns the kernel off or keeps it on its portable path;
`use_kernel` and `use_portable` do the same at run time, for comparisons in one process.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from llmserve.model import native

SOURCE = Path(__file__).with_name("csrc") / "linear_bf16_cpu.c"
MAX_ROWS = 8  # above this oneDNN's blocked GEMM is as fast or faster (see BENCHMARKS.md, issue 18)

_enabled = True
_portable_only = native.portable_from_env()


def use_kernel(enabled: bool) -> None:
    """Route later small-batch bf16 linears through the kernel (True) or always through F.linear (False)."""
    global _enabled
    _enabled = enabled


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
