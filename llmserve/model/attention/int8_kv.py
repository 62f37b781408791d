"""The torch backend's int8 KV cache (`--kv-cache-dtype int8`): its layout, the write, the read.

A layer's key (or value) cache is int8 [num_blocks, kv_heads, block_size * (head_dim + 2)]: each (block,
kv head) holds block_size rows of head_dim int8 values, then block_size bfloat16 scales, value = int8 *
scale with one scale per token and kv head (absmax / 127). Rows keep their own scale, so a token's keys are
quantized once, when written, and never again; two bytes of scale per row make the cache 1.94x smaller than
bfloat16 at head_dim 64 (1.97x at 128).

The CPU decode kernel (csrc/paged_attention_cpu.c, KV_INT8) reads the same layout in place and writes it
in the one-call decoder with the same arithmetic as `write` here, so both store the same bits.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 2  # a bfloat16 scale per row
MIN_SCALE = 1e-30  # KV_INT8_MIN_SCALE in the C source: an all-zero row stores zeros, not 0 / 0


def cache_shape(num_blocks: int, kv_heads: int, block_size: int, head_dim: int) -> tuple[int, int, int]:
    return (num_blocks, kv_heads, block_size * (head_dim + SCALE_BYTES))


def block_size_of(cache: torch.Tensor, head_dim: int) -> int:
    return cache.shape[-1] // (head_dim + SCALE_BYTES)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [..., head_dim] as (int8 values, bfloat16 scales [...]): scale = absmax / 127 rounded to
    bfloat16, values x / scale rounded half to even (what the C side's store_row computes)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / 127).clamp_min(MIN_SCALE).to(torch.bfloat16)
    values = torch.round(xf / scale.float().unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return values, scale


def _split(cache: torch.Tensor, block_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a cache's (or of gathered regions') values [..., block_size, head_dim] and scales [..., block_size]."""
    split = block_size * head_dim
    values = cache[..., :split].unflatten(-1, (block_size, head_dim))
    scales = cache[..., split:].view(torch.bfloat16)
    return values, scales


def write(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor) -> None:
    """Store rows x [T, kv_heads, head_dim] at (blocks[t], offsets[t]) of the cache."""
    head_dim = x.shape[-1]
    values, scales = _split(cache, block_size_of(cache, head_dim), head_dim)
    q, s = quantize(x)
    values[blocks, :, offsets] = q
    scales[blocks, :, offsets] = s


def dequantize(regions: torch.Tensor, block_size: int, head_dim: int, out: torch.Tensor) -> torch.Tensor:
    """Gathered (block, kv head) regions [N, block_size * (head_dim + 2)] into `out` [N, block_size, head_dim]."""
    values, scales = _split(regions, block_size, head_dim)
    # the product in float32 is exact (7 bits times 8), so out gets it rounded once
    return torch.mul(values, scales.float().unsqueeze(-1), out=out)
