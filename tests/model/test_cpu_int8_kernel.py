"""The int8-weight linear kernel for CPUs against dequantize-then-matmul in float64, on each of its
implementations built here, and `--quantization int8` routing decode-sized bf16 batches to it."""

from __future__ import annotations

import pytest
import torch

from llmserve.model import cpu_linear
from llmserve.model.layers import Linear
from llmserve.model.quantization.int8 import INT8_KERNEL_MAX_ROWS, Int8LinearMethod, quantize_int8

pytestmark = pytest.mark.skipif(cpu_linear.load_int8() is None, reason="the CPU kernel could not be built here")

PATHS = [*cpu_linear.int8_fast_paths(), "portable"]  # every implementation built here
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13]  # every tile shape of both fast paths, and tiles after a full one


def _quantized(shape: tuple[int, int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_int8(torch.randn(shape, generator=gen) * 0.05)


def _x(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


def _assert_close(got: torch.Tensor, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None = None) -> None:
    """`got` against x @ (q * scale)^T (+ bias) computed in float64."""
    w64 = q.double() * scale.double()[:, None]
    x64 = x.double()
    expected = x64 @ w64.T if bias is None else x64 @ w64.T + bias.double()
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    # one bf16 rounding of the float32 result (2^-8 relative), plus float32 summation-order noise
    bound = expected.abs() * 2.0**-8 + 1e-5 * (x64.abs() @ w64.abs().T)
    error = (got.double() - expected).abs()
    assert bool((error <= bound).all()), f"max error {error.max():.3g} over bound {(error - bound).max():.3g}"


# (N, K) of the built-in models' projections: qkv, o, gate_up, down. The 8b's come with fewer rows than its
# 6144-28672 (its weights run to hundreds of MB): the kernel's work per row does not depend on N.
MODEL_SHAPES = {
    "tiny": [(128, 64), (64, 64), (384, 64), (64, 192)],
    "small": [(512, 256), (256, 256), (1408, 256), (256, 704)],
    "medium": [(2048, 1024), (1024, 1024), (5632, 1024), (1024, 2816)],
    "8b": [(768, 4096), (160, 14336)],
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("size", list(MODEL_SHAPES))
def test_model_shapes(path, size):
    gen = torch.Generator().manual_seed(len(size))
    for n, k in MODEL_SHAPES[size]:
        q, scale = _quantized((n, k), gen)
        for rows in ROWS:
            x = _x((rows, k), gen)
            _assert_close(cpu_linear.int8_linear(x, q, scale, path=path), x, q, scale)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", [*ROWS, 17])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (3, 17), (5, 31), (7, 33), (13, 100), (37, 1000), (129, 2817)])
def test_odd_shapes_with_bias(path, rows, n, k):
    # k not a multiple of 32 (or below 16) takes the masked tail; 17 rows: the kernel takes any count
    gen = torch.Generator().manual_seed(rows * 7919 + n * 31 + k)
    (q, scale), x, bias = _quantized((n, k), gen), _x((rows, k), gen), _x((n,), gen)
    _assert_close(cpu_linear.int8_linear(x, q, scale, bias, path=path), x, q, scale, bias)


@pytest.mark.parametrize("path", PATHS)
def test_extreme_weights_and_zero_rows(path):
    # every weight at +-127 (the widest int8 -> bf16 conversion) and an all-zero row (scale 1)
    gen = torch.Generator().manual_seed(2)
    q = torch.where(torch.rand(40, 96, generator=gen) < 0.5, -127, 127).to(torch.int8)
    q[7] = 0
    scale = torch.rand(40, generator=gen) + 0.5
    x = _x((3, 96), gen)
    got = cpu_linear.int8_linear(x, q, scale, path=path)
    _assert_close(got, x, q, scale)
    assert bool((got[:, 7] == 0).all())


@pytest.mark.parametrize("path", PATHS)
def test_strided_inputs(path):
    gen = torch.Generator().manual_seed(3)
    wide = _x((5, 3 * 96), gen)
    q, scale = _quantized((40, 96), gen)
    row_view = wide[:, 96:192]  # rows 288 elements apart, as the q part of a fused qkv output
    _assert_close(cpu_linear.int8_linear(row_view, q, scale, path=path), row_view, q, scale)
    transposed = _x((96, 5), gen).T  # columns not contiguous: copied first
    _assert_close(cpu_linear.int8_linear(transposed, q, scale, path=path), transposed, q, scale)


@pytest.mark.parametrize("path", cpu_linear.FAST_PATHS)
def test_a_path_not_built_is_refused(path):
    if path in cpu_linear.int8_fast_paths():
        pytest.skip("built on this machine")
    gen = torch.Generator().manual_seed(9)
    q, scale = _quantized((64, 256), gen)
    x = _x((3, 256), gen)
    with pytest.raises(RuntimeError, match="rejected its arguments"):
        cpu_linear.int8_linear(x, q, scale, path=path)


def test_env_portable_switch_matches_the_portable_path():
    gen = torch.Generator().manual_seed(4)
    q, scale = _quantized((64, 256), gen)
    x = _x((3, 256), gen)
    portable = cpu_linear.int8_linear(x, q, scale, path="portable")
    try:
        cpu_linear.use_path("portable")
        assert torch.equal(cpu_linear.int8_linear(x, q, scale), portable)
    finally:
        cpu_linear.use_path("best")


def _int8_layer(n: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> Linear:
    layer = Linear(k, n, True, dtype)
    q, scale = _quantized((n, k), gen)
    layer.weight = torch.nn.Parameter(q, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    layer.bias.data.copy_(_x((n,), gen))
    layer.quant_method = Int8LinearMethod()
    layer.quant_method.process_weights(layer, dtype)
    return layer


def _old_path(layer: Linear, x: torch.Tensor) -> torch.Tensor:
    """What the layer computed before the kernel: torch's int8 kernel or converted weights, then the bias."""
    if x.shape[0] <= INT8_KERNEL_MAX_ROWS and x.shape[1] % 16 == 0:
        out = torch._weight_int8pack_mm(x, layer.weight, layer.kernel_scale)
    elif cpu_linear.float32_gemm_pays(x):  # a CPU without native bf16 GEMM
        return cpu_linear.float32_gemm(x, layer.weight, layer.weight_scale, layer.bias)
    else:
        out = torch.nn.functional.linear(x, layer.weight.to(x.dtype)) * layer.kernel_scale
    return out + layer.bias


def test_int8_layers_route_decode_sized_bf16_batches_to_the_kernel():
    gen = torch.Generator().manual_seed(5)
    layer = _int8_layer(64, 256, torch.bfloat16, gen)
    small, large = _x((cpu_linear.int8_max_rows(), 256), gen), _x((cpu_linear.int8_max_rows() + 1, 256), gen)
    kernel = cpu_linear.int8_linear(small, layer.weight, layer.weight_scale, layer.bias)
    if cpu_linear.int8_fast_paths():
        assert torch.equal(layer(small), kernel)
        assert torch.equal(layer(small.reshape(2, -1, 256)), kernel.reshape(2, -1, 64))
    else:  # the plain-C path runs only when asked for
        assert torch.equal(layer(small), _old_path(layer, small))
    assert torch.equal(layer(large), _old_path(layer, large))
    try:
        cpu_linear.use_path("portable")
        assert torch.equal(layer(small), cpu_linear.int8_linear(small, layer.weight, layer.weight_scale, layer.bias,
                                                                path="portable"))
        cpu_linear.use_int8_kernel(False)
        assert torch.equal(layer(small), _old_path(layer, small))
        cpu_linear.use_int8_kernel(True)
        cpu_linear.use_kernel(False)
        assert torch.equal(layer(small), _old_path(layer, small))
    finally:
        cpu_linear.use_path("best")
        cpu_linear.use_int8_kernel(True)
        cpu_linear.use_kernel(True)


def test_float32_activations_keep_torchs_int8_kernel():
    gen = torch.Generator().manual_seed(6)
    layer = _int8_layer(64, 256, torch.float32, gen)
    x = torch.randn(3, 256, generator=gen)
    assert torch.equal(layer(x), _old_path(layer, x))
