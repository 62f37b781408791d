"""int8-weight x bf16/fp16 activation matmul for CUDA (W8A16), in Triton.

out[M, N] = (x[M, K] @ w[N, K]^T) * scale[N] (+ bias[N]). Each program computes a BLOCK_M x BLOCK_N tile,
reading the int8 weights once and converting them to the activation dtype in registers (exact: |q| <=
127), so a decode step reads half the weight bytes of a bf16 matmul; accumulation is float32 and the
per-channel scale is applied to the accumulator. Small tiles along N give a decode-sized M (1-16 rows)
enough programs to fill the GPU. Runs on CPU tensors in Triton's interpreter when TRITON_INTERPRET=1 is
set before this module is imported (for tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def w8a16_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None],
                    mask=k_mask[:, None] & col_mask[None, :], other=0)
        acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")
    acc = acc * tl.load(scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def w8a16_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (last dim contiguous) times int8 `weight` [N, K] with float32 per-row `scale` [N]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m = min(64, max(16, _next_pow2(m)))  # tl.dot wants at least 16 rows
    block_n = 32 if m <= 16 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    w8a16_matmul_kernel[grid](
        x, weight, scale, bias if bias is not None else scale, out, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64,
    )
    return out
