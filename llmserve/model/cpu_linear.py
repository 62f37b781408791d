"""Linear layers for decode-sized batches on CPU: bf16 weights (csrc/linear_bf16_cpu.c) and int8 weights with
per-channel scales (csrc/linear_int8_cpu.c, `--quantization int8`).

A decode step multiplies a few rows of activations by every weight matrix, so its time is the time to
stream the weights from memory. oneDNN's bf16 GEMM (what `F.linear` runs) reaches a fraction of the
machine's read bandwidth at such shapes; the kernel reads each weight row once, front to back, and dots it
with every row of x while it is in cache. It runs where it was built with AVX512-BF16, with AVX-512 without
BF16 (Skylake-SP to Ice Lake), or with AVX2 and FMA (most other x86 CPUs); elsewhere its plain-C implementation
is slower than oneDNN and runs only when asked for (LLMSERVE_CPU_KERNELS=portable, for tests and comparisons).
Calls with more rows than `max_rows()` (prefill, large batches; 16 on the AVX512-BF16 path, 32 on the AVX-512
one, 8 on the others) go to `F.linear` where torch's bf16 GEMM runs on bf16 instructions (`native_bf16_gemm`),
and elsewhere to `float32_gemm`, float32 GEMM on weights converted a block at a time: 2.6x oneDNN's emulated
bf16 on Ice Lake, 3.6-7x torch's generic bf16 loop on Zen 3. The int8 kernel converts each int8 weight
exactly on the fly and runs the same dot products, so it computes weight-only quantization's result while
reading half the bytes; `quantization.int8` calls it for up to `int8_max_rows()` rows.

LLMSERVE_CPU_KERNELS (see `llmserve.model.native`) turns the kernels off or keeps them on their portable
path; `use_kernel` (both kernels), `use_int8_kernel` and `use_path` do the same at run time, for
comparisons in one process (`use_path` can also name one of several fast paths built, as "avx2" on an
AVX512-BF16 machine, so tests cover each).
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
# (see BENCHMARKS.md, issue 18), on the AVX2 and portable paths.
MAX_ROWS = 8
# The AVX512-BF16 path takes two weight rows a tile from 8 rows of x up, so each vector of x loaded serves both:
# on Zen 4 it stays ahead of oneDNN up to 24 rows (1.6x at 12, 1.5x at 16), and decode steps of 12 and 16
# sequences ran 1.31x and 1.16x faster with it than with oneDNN (BENCHMARKS.md, issue 18). Where the CPU has
# AMX, oneDNN's bf16 GEMM runs on its tiles, which no measurement here has compared: the limit stays 8 there.
AVX512_BF16_MAX_ROWS = MAX_ROWS if "amx_bf16" in native.cpu_flags() else 16
# The int8 kernel stays ahead of converting the weights for oneDNN up to 16 rows: 1.4-1.7x at 12-16 rows on the
# AVX-512 Xeon (1.2x at 24, even at 32), and even with float32_gemm at 16 rows on Zen 3's AVX2 path (BENCHMARKS.md,
# issue 18).
INT8_MAX_ROWS = 16
# The AVX-512 path without BF16 (Ice Lake and older Xeons) takes two weight rows a tile from 8 rows of x up, for
# bf16 and int8 weights: on a 2-core Ice Lake both stay ahead of float32_gemm (what runs above, oneDNN's bf16 being
# emulated there) up to 48 rows: at 24-32 rows bf16 by 1.6-1.7x, int8 by 2.0-2.2x (and `_weight_int8pack_mm` by
# 1.4-1.5x) (BENCHMARKS.md, issue 18).
AVX512_MAX_ROWS = 32
FLOAT32_BLOCK = 256  # weight rows per float32 block in `float32_gemm` (64-1024 measured: 256 best or within 3%)
# Tuning constants of csrc/bf16.h chosen for this CPU: AMD's prefetchers stream a single row's weights faster
# without the software prefetch (BF16_ONE_ROW_PREFETCH).
TUNING: tuple[str, ...] = ("BF16_ONE_ROW_PREFETCH=0",) if native.cpu_vendor() == "AuthenticAMD" else ()

_enabled = True
_int8_enabled = True
# The kernels' implementations (PATH_* in csrc/bf16.h): "best" is the fastest compiled in.
PATHS = {"best": 0, "portable": 1, "avx2": 2, "avx512_bf16": 3, "avx512": 4}
FAST_PATHS = ("avx512_bf16", "avx512", "avx2")  # fastest first
_path = "portable" if native.portable_from_env() else "best"


def use_kernel(enabled: bool) -> None:
    """Route later small-batch bf16 linears through the kernel (True) or always through F.linear (False)."""
    global _enabled
    _enabled = enabled


def use_int8_kernel(enabled: bool) -> None:
    """Route later small-batch int8 linears through the int8 kernel (True, if `use_kernel` allows) or through
    torch's int8 path (False), for comparisons."""
    global _int8_enabled
    _int8_enabled = enabled


def use_path(path: str) -> None:
    """Send later kernel calls to the implementation `path` names (a key of PATHS; one not built is refused
    by each call)."""
    global _path
    if path not in PATHS:
        raise ValueError(f"unknown kernel path {path!r}: one of {sorted(PATHS)}")
    _path = path


def current_path() -> str:
    return _path


def tuned(defines: tuple[str, ...] = ()) -> tuple[str, ...]:
    """`TUNING` with `defines` (NAME=VALUE) in place of the same names: what the kernels are built with."""
    chosen = dict(define.split("=", 1) for define in TUNING)
    chosen.update(define.split("=", 1) for define in defines)
    return tuple(f"{name}={value}" for name, value in chosen.items())


@functools.cache
def load(defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The kernel library, built on first use; None when it cannot be built or kernels are off. `defines`
    builds a variant of its tuning constants (NAME=VALUE, over this CPU's `TUNING`), for benchmarks and tests."""
    lib = native.load_library(SOURCE, defines=tuned(defines))
    if lib is None:
        return None
    lib.llmserve_linear_bf16.restype = ctypes.c_int
    lib.llmserve_linear_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 6
    lib.llmserve_linear_bf16_paths.restype = ctypes.c_int
    return lib


def _fast_paths_built(lib: ctypes.CDLL | None, paths_fn: str) -> tuple[str, ...]:
    if lib is None:
        return ()
    built = getattr(lib, paths_fn)()
    return tuple(name for name in FAST_PATHS if built >> PATHS[name] & 1)


@functools.cache
def fast_paths() -> tuple[str, ...]:
    """The bf16 kernel's fast implementations compiled in, fastest first: "avx512_bf16" where the machine has
    AVX512-BF16, "avx2" where it has AVX2 and FMA."""
    return _fast_paths_built(load(), "llmserve_linear_bf16_paths")


def _runs(fast: tuple[str, ...], lib: ctypes.CDLL | None) -> bool:
    """Whether calls should go to a kernel with these fast paths: one is built, or another path was asked for."""
    return lib is not None and (bool(fast) if _path == "best" else _path == "portable" or _path in fast)


def bf16_kernel_runs() -> bool:
    """Whether small bf16 linears go to the bf16 kernel (on the path `use_path` chose)."""
    return _enabled and _runs(fast_paths(), load())


def int8_kernel_runs() -> bool:
    """Whether small int8 linears go to the int8 kernel (on the path `use_path` chose)."""
    return _enabled and _int8_enabled and _runs(int8_fast_paths(), load_int8())


def _path_code(path: str) -> int:
    return PATHS[_path if path == "best" else path]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the kernel when x is a few bf16 rows on the CPU, and in float32 blocks
    for more bf16 rows on a CPU without native bf16 GEMM (`float32_gemm_pays`)."""
    if _fits(x, weight) and bf16_kernel_runs():
        return bf16_linear(x, weight, bias)
    if weight.dtype == torch.bfloat16 and float32_gemm_pays(x):
        return float32_gemm(x, weight, bias=bias)
    return F.linear(x, weight, bias)


@functools.cache
def native_bf16_gemm() -> bool:
    """Whether torch's CPU bf16 GEMM runs on bf16 instructions: oneDNN's, on AVX512-BF16 or AMX. Without AVX-512
    torch runs a generic loop at ~10 GFLOP/s a core; on AVX-512 CPUs without BF16 (Skylake-SP to Ice Lake)
    oneDNN emulates bf16 at 45-60 GFLOP/s over two cores. Float32 GEMM on converted weights reaches 35-75 a
    core on Zen 3 and 155-160 over two Ice Lake cores (BENCHMARKS.md, issue 18). Where /proc/cpuinfo has no x86
    flags (other architectures), torch's own answer stands."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    flags = native.cpu_flags()
    return "sse2" not in flags or bool({"avx512_bf16", "amx_bf16"} & flags)


def float32_gemm_pays(x: torch.Tensor) -> bool:
    """Whether a bf16 product with x should run as `float32_gemm`: bf16 x on a CPU without native bf16 GEMM,
    kernels on (`use_kernel(False)` keeps torch's own path, for comparisons)."""
    return _enabled and x.dtype == torch.bfloat16 and x.device.type == "cpu" and not native_bf16_gemm()


def float32_gemm(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] * scale [N])^T (+ bias [N]) in float32, rounded to x's dtype once: the weights
    (bf16 or int8, both exact in float32) are converted FLOAT32_BLOCK rows at a time, so the converted block
    stays in cache and the GEMM is float32's (BENCHMARKS.md, issue 18: 3.6-7x torch's bf16 GEMM at 16-512
    rows on an AVX2 CPU)."""
    x32 = x.reshape(-1, x.shape[-1]).float()
    n = weight.shape[0]
    out = torch.empty(x32.shape[0], n, dtype=x.dtype)
    for first in range(0, n, FLOAT32_BLOCK):
        rows = slice(first, min(first + FLOAT32_BLOCK, n))
        block = F.linear(x32, weight[rows].float())
        if scale is not None:
            block.mul_(scale[rows].float())
        if bias is not None:
            block.add_(bias[rows].float())
        out[:, rows] = block
    return out.reshape(*x.shape[:-1], n)


def _running_path(fast: tuple[str, ...]) -> str:
    return _path if _path != "best" else next(iter(fast), "portable")


_BF16_MAX_ROWS = {"avx512_bf16": AVX512_BF16_MAX_ROWS, "avx512": AVX512_MAX_ROWS}  # MAX_ROWS on the other paths


def max_rows() -> int:
    """The most rows of x the bf16 kernel takes, on the path it runs now."""
    return _BF16_MAX_ROWS.get(_running_path(fast_paths()), MAX_ROWS)


def int8_max_rows() -> int:
    """The most rows of x the int8 kernel takes, on the path it runs now."""
    return AVX512_MAX_ROWS if _running_path(int8_fast_paths()) == "avx512" else INT8_MAX_ROWS


def _fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
        and x.dim() == 2 and x.shape[0] <= max_rows() and weight.is_contiguous()
    )


def bf16_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, path: str = "best"
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) by the kernel, bf16 in and out; `path` (a key of PATHS) names
    the implementation, for tests and comparisons."""
    lib = load()
    assert lib is not None, "call load() first"
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty((rows, n), dtype=torch.bfloat16)
    if bias is not None:
        bias = bias.contiguous()
    status = lib.llmserve_linear_bf16(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                      out.data_ptr(), rows, n, k, max(x.stride(0), k), torch.get_num_threads(),
                                      _path_code(path))
    if status != 0:
        raise RuntimeError("linear_bf16 kernel rejected its arguments")
    return out


@functools.cache
def load_int8(defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The int8 kernel library, built on first use; None when it cannot be built or kernels are off
    (`defines` as for `load`)."""
    lib = native.load_library(INT8_SOURCE, defines=tuned(defines))
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.llmserve_linear_int8.restype = ctypes.c_int
    lib.llmserve_linear_int8.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int, ctypes.c_int]
    lib.llmserve_linear_int8_paths.restype = ctypes.c_int
    return lib


@functools.cache
def int8_fast_paths() -> tuple[str, ...]:
    """The int8 kernel's fast implementations compiled in, fastest first (as `fast_paths`)."""
    return _fast_paths_built(load_int8(), "llmserve_linear_int8_paths")


def int8_kernel_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `int8_linear` should run x [M, K] against int8 `weight` [N, K]: few bf16 rows on the CPU, and
    the kernel built on a fast path (or another path asked for)."""
    return (
        x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= int8_max_rows()
        and weight.dtype == torch.int8 and weight.is_contiguous() and int8_kernel_runs()
    )


def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
    path: str = "best",
) -> torch.Tensor:
    """x [M, K] bf16 @ (weight [N, K] int8 * scale [N] float32)^T (+ bias [N] bf16) by the int8 kernel, bf16
    out; `path` (a key of PATHS) names the implementation, for tests and comparisons."""
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
    status = lib.llmserve_linear_int8(x.data_ptr(), rows, k, max(x.stride(0), k), weight.data_ptr(), scale.data_ptr(),
                                      None if bias is None else bias.data_ptr(), n, out.data_ptr(),
                                      torch.get_num_threads(), _path_code(path))
    if status != 0:
        raise RuntimeError("linear_int8 kernel rejected its arguments")
    return out
