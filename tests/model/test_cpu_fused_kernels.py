"""The C elementwise kernels for decode-sized bf16 batches against the torch code in layers.py."""

from __future__ import annotations

import pytest
import torch

from llmserve.model import cpu_fused, layers
from llmserve.model.config import RopeConfig

pytestmark = pytest.mark.skipif(cpu_fused.load() is None, reason="the CPU kernel could not be built here")


@pytest.fixture
def torch_path():
    """Run layers' torch code (the reference) while the fixture is active."""
    saved = layers.use_fused_kernels
    layers.use_fused_kernels = False
    yield
    layers.use_fused_kernels = saved


def _bf16(shape: tuple[int, ...], gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)


def _norm(n: int, gen: torch.Generator) -> layers.RMSNorm:
    norm = layers.RMSNorm(n, 1e-5, torch.bfloat16)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(n, generator=gen))
    return norm


def _mostly_equal(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-equal but for a float32 sum of squares added in another order: rare 1-ulp bf16 differences."""
    assert got.shape == expected.shape and got.dtype == expected.dtype
    differ = got != expected
    assert differ.float().mean() < 0.01
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("n", [64, 1024, 4096, 100])
def test_norms(torch_path, tokens, n):
    gen = torch.Generator().manual_seed(tokens * 1000 + n)
    norm = _norm(n, gen)
    x, residual = _bf16((tokens, n), gen, 3.0), _bf16((tokens, n), gen)
    expected = norm(x)
    expected_pair = norm(x, residual)
    _mostly_equal(cpu_fused.rms_norm(x, norm.weight, norm.eps), expected)
    out, new_residual = cpu_fused.fused_add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(new_residual, expected_pair[1])
    _mostly_equal(out, expected_pair[0])


def test_per_head_norm_of_a_strided_view(torch_path):
    gen = torch.Generator().manual_seed(1)
    qkv = _bf16((5, 8 * 32 + 2 * 4 * 32), gen, 2.0)
    q = qkv[:, : 8 * 32].view(5, 8, 32)  # rows of 32 within tokens 384 elements apart, as Qwen3's q_norm
    norm = _norm(32, gen)
    _mostly_equal(cpu_fused.rms_norm(q, norm.weight, norm.eps), norm(q))


@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(16, 8, 64), (4, 2, 16), (32, 8, 128)])
def test_rotary_matches_bit_for_bit(torch_path, tokens, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(heads + dim + tokens)
    rotary = layers.RotaryEmbedding(dim, 4096, RopeConfig(theta=500000.0))
    qkv = _bf16((tokens, (heads + 2 * kv_heads) * dim), gen)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    q_view = qkv[:, : heads * dim].view(tokens, heads, dim)
    k_view = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    expected_q, expected_k = rotary(positions, q_view, k_view)
    q, k = cpu_fused.apply_rotary(positions, q_view, k_view, rotary.cos_cache, rotary.sin_cache)
    assert q.data_ptr() == q_view.data_ptr()  # in place, in the fused projection's output
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("cols", [192, 2816, 77])
def test_silu_and_mul_matches_bit_for_bit(torch_path, tokens, cols):
    gen = torch.Generator().manual_seed(tokens + cols)
    gate_up = _bf16((tokens, 2 * cols), gen, 4.0)
    assert torch.equal(cpu_fused.silu_and_mul(gate_up), layers.silu_and_mul(gate_up))


def test_layers_pick_the_c_kernels_for_decode_sized_bf16_cpu_tensors():
    small = torch.zeros(layers.cpu_linear.max_rows(), 64, dtype=torch.bfloat16)
    assert layers.fused_kernels_for(small) is cpu_fused
    assert layers.fused_kernels_for(torch.zeros(layers.cpu_linear.max_rows() + 1, 64, dtype=torch.bfloat16)) is None
    assert layers.fused_kernels_for(small.float()) is None
