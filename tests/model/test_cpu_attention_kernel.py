"""The C decode kernel against the PyTorch path of the same backend, on random paged caches."""

from __future__ import annotations

import pytest
import torch

from llmserve.model.attention import cpu_kernels, int8_kv
from llmserve.model.attention.base import AttentionMetadata
from llmserve.model.attention.torch_ref import TorchAttentionBackend

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernel could not be built here")


def _decode_meta(lens: list[int], tables: torch.Tensor) -> AttentionMetadata:
    count = len(lens)
    return AttentionMetadata(
        slot_mapping=torch.zeros(count, dtype=torch.long),
        query_start_loc=torch.arange(count + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        num_decodes=count,
        num_decode_tokens=count,
        max_seq_len=max(lens),
        query_start_loc_host=list(range(count + 1)),
        seq_lens_host=lens,
    )


@pytest.mark.parametrize("portable", [False, True], ids=["best", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2), (8, 1), (16, 2), (32, 8)])
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (128, 16), (48, 16), (40, 8), (64, 32), (64, 128)])
def test_kernel_matches_the_torch_path(portable, dtype, heads, kv_heads, head_dim, block_size):
    # head_dim 48 takes the AVX-512 path without the bf16 dot product, 40 and block 128 the portable one
    gen = torch.Generator().manual_seed(heads * 100 + kv_heads + head_dim + block_size)
    lens = [1, 15, 16, 17, 100, 203, 700]  # partial blocks, exact blocks, one token, many blocks
    num_blocks = sum(-(-n // block_size) for n in lens) + 4
    max_blocks = -(-max(lens) // block_size)
    # every sequence gets distinct, shuffled (non-contiguous) blocks; table padding points at block 0
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        need = -(-n // block_size)
        tables[i, :need] = perm[used : used + need]
        used += need
    shape = (num_blocks, kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5

    reference = TorchAttentionBackend(heads, kv_heads, head_dim, block_size, dtype=torch.float16)  # no kernel
    meta = _decode_meta(lens, tables)
    reference.prepare(meta)
    assert meta.backend_data["decode_kernel"] is False
    expected = reference._decode(q.float(), k_cache.float(), v_cache.float(), meta)

    out = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, meta.seq_lens, scale, portable=portable)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_backend_routes_cpu_decodes_through_the_kernel():
    backend = TorchAttentionBackend(8, 2, 64, 16, dtype=torch.bfloat16)
    meta = _decode_meta([5, 9], torch.tensor([[0], [1]], dtype=torch.int32))
    backend.prepare(meta)
    assert meta.backend_data["decode_kernel"] is True


def test_use_portable_switches_every_later_call():
    gen = torch.Generator().manual_seed(7)
    k_cache = torch.randn(8, 2, 16, 64, generator=gen)
    v_cache = torch.randn(8, 2, 16, 64, generator=gen)
    tables = torch.arange(8, dtype=torch.int32).view(2, 4)
    lens = torch.tensor([60, 33], dtype=torch.int32)
    q = torch.randn(2, 8, 64, generator=gen)
    portable = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, 0.125, portable=True)
    best = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, 0.125)
    if torch.equal(portable, best):
        pytest.skip("both implementations give the same bits here (no AVX-512 build)")
    try:
        cpu_kernels.use_portable(True)
        assert torch.equal(cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, 0.125), portable)
    finally:
        cpu_kernels.use_portable(False)
    assert torch.equal(cpu_kernels.paged_decode(q, k_cache, v_cache, tables, lens, 0.125), best)


@pytest.mark.parametrize("portable", [False, True], ids=["best", "portable"])
def test_kv_prefetch_changes_no_result(portable):
    """The KV prefetch (KV_PREFETCH_BLOCKS, measured by benchmarks/cpu_attention.py) moves only timing: the kernel
    built without it returns the same bits."""
    gen = torch.Generator().manual_seed(3)
    lens, block_size, heads, kv_heads, dim = [1, 16, 17, 300], 16, 16, 8, 64
    max_blocks = -(-max(lens) // block_size)
    shape = (len(lens) * max_blocks, kv_heads, block_size, dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tables = torch.randperm(shape[0], generator=gen).view(len(lens), max_blocks).to(torch.int32)
    query = torch.randn(len(lens), heads, dim, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    expected = cpu_kernels.paged_decode(query, k_cache, v_cache, tables, seq_lens, dim**-0.5, portable=portable)
    without = cpu_kernels.load(("KV_PREFETCH_BLOCKS=0",))
    fn = without.llmserve_paged_decode_portable if portable else without.llmserve_paged_decode
    out = torch.empty_like(query)
    assert fn(0, query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), seq_lens.data_ptr(),
              out.data_ptr(), len(lens), heads, kv_heads, dim, block_size, max_blocks, dim**-0.5, 2) == 0
    assert torch.equal(out, expected)


def _int8_caches(shape: tuple[int, int, int, int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random bf16 cache of `shape` [blocks, kv_heads, block_size, head_dim] written row by row into an int8
    cache (`--kv-cache-dtype int8`): (int8 cache, its dequantized float32 content in the bf16 layout)."""
    blocks, kv_heads, block_size, dim = shape
    rows = torch.randn(shape, generator=gen).to(torch.bfloat16)
    cache = torch.zeros(int8_kv.cache_shape(blocks, kv_heads, block_size, dim), dtype=torch.int8)
    block_ids = torch.arange(blocks).repeat_interleave(block_size)
    offsets = torch.arange(block_size).repeat(blocks)
    int8_kv.write(cache, block_ids, offsets, rows.transpose(1, 2).reshape(-1, kv_heads, dim))
    dequantized = torch.empty(blocks * kv_heads, block_size, dim)
    int8_kv.dequantize(cache.view(blocks * kv_heads, -1), block_size, dim, dequantized)
    return cache, dequantized.view(shape)


@pytest.mark.parametrize("portable", [False, True], ids=["best", "portable"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (16, 8), (8, 1), (32, 8)])
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (128, 16), (48, 16), (64, 8), (40, 16), (64, 128)])
def test_int8_cache_kernel_matches_attention_over_the_dequantized_cache(portable, heads, kv_heads, head_dim,
                                                                        block_size):
    # 64/128 x 16: 16-row stretches; 48: other multiples of 16; block 8: rows one at a time; 40 and block 128:
    # the portable implementation
    gen = torch.Generator().manual_seed(heads + head_dim + block_size)
    lens = [1, 15, 16, 17, 100, 203, 700]
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks
    tables = torch.randperm(num_blocks, generator=gen).view(len(lens), max_blocks).to(torch.int32)
    k_cache, k_values = _int8_caches((num_blocks, kv_heads, block_size, head_dim), gen)
    v_cache, v_values = _int8_caches((num_blocks, kv_heads, block_size, head_dim), gen)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32)

    expected = cpu_kernels.paged_decode(q.float(), k_values, v_values, tables, seq_lens, head_dim**-0.5, portable=True)
    out = cpu_kernels.paged_decode(q, k_cache, v_cache, tables, seq_lens, head_dim**-0.5, portable=portable)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)  # bf16 output rounding


def test_int8_writes_one_row_and_its_scale():
    block_size, dim = 4, 8
    cache = torch.zeros(int8_kv.cache_shape(3, 2, block_size, dim), dtype=torch.int8)
    row = torch.tensor([[0.5, -1.0, 0.25, 2.0, 0.0, -2.0, 1.5, 0.125], [0.0] * 8], dtype=torch.bfloat16)
    int8_kv.write(cache, torch.tensor([1]), torch.tensor([2]), row.unsqueeze(0))
    values = cache[..., : block_size * dim].view(3, 2, block_size, dim)
    scales = cache[..., block_size * dim :].view(torch.bfloat16)
    scale = torch.tensor(2.0 / 127).to(torch.bfloat16)
    assert scales[1, 0, 2] == scale and scales[1, 1, 2] == torch.tensor(int8_kv.MIN_SCALE).to(torch.bfloat16)
    expected = torch.round(row[0].float() / scale.float()).clamp(-127, 127).to(torch.int8)
    assert torch.equal(values[1, 0, 2], expected) and values[1, 0, 2].abs().max() == 127
    assert torch.equal(values[1, 1, 2], torch.zeros(dim, dtype=torch.int8))  # an all-zero row stays zero
    cache[1, :, :] = 0  # nothing outside that row and its scale was written
    assert not cache.any()


def test_int8_round_trip_error_is_within_half_a_step():
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 4, 128, generator=gen) * torch.logspace(-3, 3, 64)[:, None, None]).to(torch.bfloat16)
    values, scales = int8_kv.quantize(x)
    error = (values.float() * scales.float()[..., None] - x.float()).abs()
    # a step is the bf16-rounded scale; the row's largest value may be clamped by up to half a step more
    assert (error <= scales.float()[..., None] * 0.5 * (1 + 2**-7)).all()
