"""The bf16 linear kernel for CPUs against a float32 reference, on both of its implementations."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llmserve.model import cpu_linear

pytestmark = pytest.mark.skipif(cpu_linear.load() is None, reason="the CPU kernel could not be built here")

CPUINFO = Path("/proc/cpuinfo")
PATHS = [False, True]
PATH_IDS = ["best", "portable"]


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


@pytest.mark.parametrize("portable", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("size", list(MODEL_SHAPES))
def test_model_shapes(portable, size):
    gen = torch.Generator().manual_seed(len(size))
    for n, k in MODEL_SHAPES[size]:
        w = _random((n, k), gen)
        w64 = w.double()
        for rows in (1, 3, 4, 8, 16):
            x = _random((rows, k), gen)
            _assert_close_to(cpu_linear.bf16_linear(x, w, portable=portable), x, w64, None)


@pytest.mark.parametrize("portable", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("rows", [1, 7, 17, 33, 64])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (3, 17), (5, 31), (7, 33), (13, 100), (37, 1000), (129, 2817)])
def test_odd_shapes_with_bias(portable, rows, n, k):
    # k not a multiple of 32 takes the masked tail; n not a multiple of 4 a partial block of weight rows
    gen = torch.Generator().manual_seed(rows * 7919 + n * 31 + k)
    x, w, bias = _random((rows, k), gen), _random((n, k), gen), _random((n,), gen)
    _assert_close(cpu_linear.bf16_linear(x, w, bias, portable=portable), x, w, bias)


@pytest.mark.parametrize("portable", PATHS, ids=PATH_IDS)
def test_strided_inputs(portable):
    gen = torch.Generator().manual_seed(3)
    wide, w = _random((5, 3 * 96), gen), _random((40, 96), gen)
    row_view = wide[:, 96:192]  # rows 288 elements apart, as the q part of a fused qkv output
    _assert_close(cpu_linear.bf16_linear(row_view, w, portable=portable), row_view, w, None)
    transposed = _random((96, 5), gen).T  # columns not contiguous: copied first
    _assert_close(cpu_linear.bf16_linear(transposed, w, portable=portable), transposed, w, None)


@pytest.mark.skipif(not CPUINFO.exists(), reason="needs /proc/cpuinfo")
def test_fast_path_is_built_where_the_cpu_has_avx512_bf16():
    # otherwise the "best" tests would silently test the portable path twice
    assert cpu_linear.has_fast_path() == ("avx512_bf16" in CPUINFO.read_text().split())


def test_env_portable_switch_matches_the_portable_path():
    gen = torch.Generator().manual_seed(4)
    x, w = _random((3, 256), gen), _random((64, 256), gen)
    portable = cpu_linear.bf16_linear(x, w, portable=True)
    try:
        cpu_linear.use_portable(True)
        assert torch.equal(cpu_linear.bf16_linear(x, w), portable)
    finally:
        cpu_linear.use_portable(False)


def test_linear_routes_small_bf16_batches_to_the_kernel():
    gen = torch.Generator().manual_seed(5)
    w = _random((64, 256), gen)
    small, large = _random((cpu_linear.MAX_ROWS, 256), gen), _random((cpu_linear.MAX_ROWS + 1, 256), gen)
    if cpu_linear.has_fast_path():
        assert torch.equal(cpu_linear.linear(small, w), cpu_linear.bf16_linear(small, w))
    else:  # the plain-C path is slower than oneDNN: it runs only when asked for
        assert torch.equal(cpu_linear.linear(small, w), F.linear(small, w))
    assert torch.equal(cpu_linear.linear(large, w), F.linear(large, w))
    x32, w32 = small.float(), w.float()
    assert torch.equal(cpu_linear.linear(x32, w32), F.linear(x32, w32))
    try:
        cpu_linear.use_portable(True)
        assert torch.equal(cpu_linear.linear(small, w), cpu_linear.bf16_linear(small, w, portable=True))
        cpu_linear.use_kernel(False)
        assert torch.equal(cpu_linear.linear(small, w), F.linear(small, w))
    finally:
        cpu_linear.use_portable(False)
        cpu_linear.use_kernel(True)
