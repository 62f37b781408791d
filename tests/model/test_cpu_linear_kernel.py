"""The bf16 linear kernel for CPUs against a float32 reference, on each of its implementations built here."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmserve.model import cpu_linear, native

pytestmark = pytest.mark.skipif(cpu_linear.load() is None, reason="the CPU kernel could not be built here")

CPUINFO = Path("/proc/cpuinfo")
PATHS = [*cpu_linear.fast_paths(), "portable"]  # every implementation built here


def _assert_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    _assert_close_to(got, x, w.double(), None if bias is None else bias.double())


def _assert_close_to(got: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, bias64: torch.Tensor | None) -> None:
    """`got` against x @ w64^T (+ bias64) computed in float64."""
    x64 = x.double()
    expected = x64 @ w64.T if bias64 is None else x64 @ w64.T + bias64
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    # one bf16 rounding of the float32 sum (2^-8 relative), plus float32 summation-order noise
    bound = expected.abs() * 2.0**-8 + 1e-5 * (x64.abs() @ w64.abs().T)
    error = (got.double() - expected).abs()
    assert bool((error <= bound).all()), f"max error {error.max():.3g} over bound {(error - bound).max():.3g}"


def _random(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


# (N, K) of the built-in models' projections: qkv, o, gate_up, down, lm_head. For the larger models the
# lm_head keeps a slice of its rows, and the 8b's K dimensions come with fewer rows than its 6144-28672
# (its weights run to hundreds of MB): the kernel's work per row does not depend on N.
MODEL_SHAPES = {
    "tiny": [(128, 64), (64, 64), (384, 64), (64, 192), (1024, 64)],
    "small": [(512, 256), (256, 256), (1408, 256), (256, 704), (8192, 256)],
    "medium": [(2048, 1024), (1024, 1024), (5632, 1024), (1024, 2816), (4000, 1024)],
    "8b": [(768, 4096), (160, 14336)],
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("size", list(MODEL_SHAPES))
def test_model_shapes(path, size):
    gen = torch.Generator().manual_seed(len(size))
    for n, k in MODEL_SHAPES[size]:
        w = _random((n, k), gen)
        w64 = w.double()
        for rows in (1, 3, 4, 8, 9, 12, 16):
            x = _random((rows, k), gen)
            _assert_close_to(cpu_linear.bf16_linear(x, w, path=path), x, w64, None)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", [1, 7, 10, 11, 17, 33, 64])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (3, 17), (5, 31), (7, 33), (13, 100), (37, 1000), (129, 2817)])
def test_odd_shapes_with_bias(path, rows, n, k):
    # k not a multiple of 32 takes the masked tail; n not a multiple of 4 a partial block of weight rows
    gen = torch.Generator().manual_seed(rows * 7919 + n * 31 + k)
    x, w, bias = _random((rows, k), gen), _random((n, k), gen), _random((n,), gen)
    _assert_close(cpu_linear.bf16_linear(x, w, bias, path=path), x, w, bias)


@pytest.mark.parametrize("path", PATHS)
def test_strided_inputs(path):
    gen = torch.Generator().manual_seed(3)
    wide, w = _random((5, 3 * 96), gen), _random((40, 96), gen)
    row_view = wide[:, 96:192]  # rows 288 elements apart, as the q part of a fused qkv output
    _assert_close(cpu_linear.bf16_linear(row_view, w, path=path), row_view, w, None)
    transposed = _random((96, 5), gen).T  # columns not contiguous: copied first
    _assert_close(cpu_linear.bf16_linear(transposed, w, path=path), transposed, w, None)


@pytest.mark.skipif(not CPUINFO.exists(), reason="needs /proc/cpuinfo")
def test_the_fast_paths_built_are_those_the_cpu_has():
    # otherwise the parametrized tests would silently leave a path the product runs untested
    flags = set(CPUINFO.read_text().split())
    needs = {"avx512_bf16": {"avx512_bf16"}, "avx512": {"avx512f", "avx512bw"}, "avx2": {"avx2", "fma"}}
    expected = [path for path in cpu_linear.FAST_PATHS if needs[path] <= flags]
    assert list(cpu_linear.fast_paths()) == expected
    assert list(cpu_linear.int8_fast_paths()) == expected  # the int8 kernel's, built the same way


@pytest.mark.parametrize("path", cpu_linear.FAST_PATHS)
def test_a_path_not_built_is_refused(path):
    if path in cpu_linear.fast_paths():
        pytest.skip("built on this machine")
    gen = torch.Generator().manual_seed(9)
    x, w = _random((3, 256), gen), _random((64, 256), gen)
    with pytest.raises(RuntimeError, match="rejected its arguments"):
        cpu_linear.bf16_linear(x, w, path=path)


def test_env_portable_switch_matches_the_portable_path():
    gen = torch.Generator().manual_seed(4)
    x, w = _random((3, 256), gen), _random((64, 256), gen)
    portable = cpu_linear.bf16_linear(x, w, path="portable")
    try:
        cpu_linear.use_path("portable")
        assert torch.equal(cpu_linear.bf16_linear(x, w), portable)
    finally:
        cpu_linear.use_path("best")


def test_linear_routes_small_bf16_batches_to_the_kernel():
    gen = torch.Generator().manual_seed(5)
    w = _random((64, 256), gen)
    small, large = _random((cpu_linear.max_rows(), 256), gen), _random((cpu_linear.max_rows() + 1, 256), gen)
    if bool(cpu_linear.fast_paths()):
        assert torch.equal(cpu_linear.linear(small, w), cpu_linear.bf16_linear(small, w))
    else:  # the plain-C path is slower than oneDNN: it runs only when asked for
        assert torch.equal(cpu_linear.linear(small, w), F.linear(small, w))
    if cpu_linear.native_bf16_gemm():
        assert torch.equal(cpu_linear.linear(large, w), F.linear(large, w))
    else:  # torch's bf16 GEMM is a slow generic loop there
        assert torch.equal(cpu_linear.linear(large, w), cpu_linear.float32_gemm(large, w))
    x32, w32 = small.float(), w.float()
    assert torch.equal(cpu_linear.linear(x32, w32), F.linear(x32, w32))
    try:
        cpu_linear.use_path("portable")
        assert torch.equal(cpu_linear.linear(small, w), cpu_linear.bf16_linear(small, w, path="portable"))
        cpu_linear.use_kernel(False)
        assert torch.equal(cpu_linear.linear(small, w), F.linear(small, w))
    finally:
        cpu_linear.use_path("best")
        cpu_linear.use_kernel(True)


@pytest.mark.parametrize("rows", [1, 9, 64])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.int8])
def test_float32_gemm_against_float64(rows, weight_dtype):
    # N = 600 spans three blocks, the last one partial; x has a leading batch dimension
    gen = torch.Generator().manual_seed(rows)
    n, k = 2 * cpu_linear.FLOAT32_BLOCK + 88, 96
    x = _random((2, rows, k), gen)
    if weight_dtype == torch.int8:
        w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        scale = torch.rand(n, generator=gen) / 127
    else:
        w, scale = _random((n, k), gen), None
    bias = _random((n,), gen)
    got = cpu_linear.float32_gemm(x, w, scale, bias)
    assert got.shape == (2, rows, n)
    w64 = w.double() * (1 if scale is None else scale.double()[:, None])
    _assert_close_to(got.reshape(-1, n), x.reshape(-1, k), w64, bias.double())


def test_native_bf16_gemm_means_bf16_instructions_not_onednns_emulation():
    flags = set(CPUINFO.read_text().split()) if CPUINFO.exists() else set()
    if "sse2" not in flags:
        pytest.skip("needs an x86 /proc/cpuinfo")
    onednn_bf16 = {"avx512bw", "avx512vl", "avx512dq"} <= flags
    assert cpu_linear.native_bf16_gemm() == (onednn_bf16 and bool({"avx512_bf16", "amx_bf16"} & flags))


@pytest.mark.parametrize("rows", [1, 3, 13])
@pytest.mark.parametrize(
    "variant",
    ["WEIGHT_PREFETCH_BYTES=0", "BF16_ONE_ROW_PREFETCH=0", "BF16_ONE_ROW_PREFETCH=1", "BF16_TILE_COLS=1",
     "INT8_TILE_COLS=1"],
)
@pytest.mark.parametrize("path", PATHS)
def test_tuning_constants_change_no_result(path, variant, rows):
    """The kernels' tuning constants (the prefetch's settings of csrc/bf16.h, measured by
    benchmarks/cpu_weight_prefetch.py, one of them chosen per CPU vendor; one or two weight rows a tile) move
    only timing: other builds give the same bits on every implementation, for both kernels."""
    gen = torch.Generator().manual_seed(5)
    n, k = 300, 1000
    x, w = _random((rows, k), gen), _random((n, k), gen)
    q, scale = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8), torch.rand(n, generator=gen)
    code = cpu_linear.PATHS[path]
    bf16_lib = cpu_linear.load((variant,))
    int8_lib = cpu_linear.load_int8((variant,))
    plain_bf16, plain_int8 = torch.empty(rows, n, dtype=torch.bfloat16), torch.empty(rows, n, dtype=torch.bfloat16)
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    assert bf16_lib.llmserve_linear_bf16(ptr(x.data_ptr()), ptr(w.data_ptr()), None, ptr(plain_bf16.data_ptr()),
                                         rows, n, k, k, 2, code) == 0
    assert int8_lib.llmserve_linear_int8(ptr(x.data_ptr()), i64(rows), i64(k), i64(k), ptr(q.data_ptr()),
                                         ptr(scale.data_ptr()), None, i64(n), ptr(plain_int8.data_ptr()), 2, code) == 0
    assert torch.equal(cpu_linear.bf16_linear(x, w, path=path), plain_bf16)
    assert torch.equal(cpu_linear.int8_linear(x, q, scale, path=path), plain_int8)


def _direct(x: torch.Tensor, w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, threads: int,
            code: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both kernels called with `threads` OpenMP threads (the wrappers take torch's count)."""
    rows, k = x.shape
    n = w.shape[0]
    bf16, int8 = torch.empty(rows, n, dtype=torch.bfloat16), torch.empty(rows, n, dtype=torch.bfloat16)
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    assert cpu_linear.load().llmserve_linear_bf16(ptr(x.data_ptr()), ptr(w.data_ptr()), None, ptr(bf16.data_ptr()),
                                                  rows, n, k, k, threads, code) == 0
    assert cpu_linear.load_int8().llmserve_linear_int8(ptr(x.data_ptr()), i64(rows), i64(k), i64(k),
                                                       ptr(q.data_ptr()), ptr(scale.data_ptr()), None, i64(n),
                                                       ptr(int8.data_ptr()), threads, code) == 0
    return bf16, int8


def _order_sensitive(rows: int, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """x, and weights of +-1 in bf16 and int8: each row of x holds eight pairs of +-2^24 among small integers, so
    which small products a float32 sum keeps depends on the order it adds them in."""
    x = torch.randint(-4, 5, (rows, k), generator=gen).float()
    for i in range(rows):
        for a, b in torch.randperm(k, generator=gen)[:16].view(8, 2).tolist():
            x[i, a], x[i, b] = 2.0**24, -(2.0**24)
    signs = torch.randint(0, 2, (n, k), generator=gen) * 2 - 1
    return x.bfloat16(), signs.bfloat16(), signs.to(torch.int8)


@pytest.mark.parametrize("rows", [1, 5, 9, 10, 11, 16])
@pytest.mark.parametrize("path", PATHS)
def test_results_do_not_depend_on_the_number_of_threads(path, rows):
    # threads take odd stretches of weight rows, so a row paired with its neighbour in one split stands alone in
    # another: its products must be summed in the same order either way
    gen = torch.Generator().manual_seed(rows)
    x, w, q = _order_sensitive(rows, 61, 1000, gen)
    code = cpu_linear.PATHS[path]
    one = _direct(x, w, q, torch.ones(61), 1, code)
    for threads in (2, 3, 5, 7):
        assert all(torch.equal(a, b) for a, b in zip(_direct(x, w, q, torch.ones(61), threads, code), one, strict=True))


def test_builds_take_this_cpus_tuning_and_explicit_defines_over_it(monkeypatch):
    monkeypatch.setattr(cpu_linear, "TUNING", ("BF16_ONE_ROW_PREFETCH=0",))
    assert cpu_linear.tuned() == ("BF16_ONE_ROW_PREFETCH=0",)
    assert cpu_linear.tuned(("BF16_ONE_ROW_PREFETCH=1", "WEIGHT_PREFETCH_BYTES=0")) == (
        "BF16_ONE_ROW_PREFETCH=1", "WEIGHT_PREFETCH_BYTES=0"
    )


def test_the_kernels_take_more_rows_on_the_avx512_paths():
    bf16_limits = {"avx512_bf16": cpu_linear.AVX512_BF16_MAX_ROWS, "avx512": cpu_linear.AVX512_MAX_ROWS}
    try:
        for path in PATHS:
            cpu_linear.use_path(path)
            assert cpu_linear.max_rows() == bf16_limits.get(path, 8)
            assert cpu_linear.int8_max_rows() == (32 if path == "avx512" else 16)
    finally:
        cpu_linear.use_path("best")
    best = next(iter(cpu_linear.fast_paths()), "portable")
    assert cpu_linear.max_rows() == bf16_limits.get(best, 8)
    # 16 where AVX512-BF16 runs without AMX (oneDNN's GEMM on AMX tiles was never compared with the kernel)
    assert cpu_linear.AVX512_BF16_MAX_ROWS == (8 if "amx_bf16" in native.cpu_flags() else 16)
