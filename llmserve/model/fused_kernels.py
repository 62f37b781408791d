"""Fused Triton kernels for the decoder's elementwise work: residual add + RMSNorm, RMSNorm alone (also
per head, for Qwen3's q/k norms), rotary embedding of q and k together, and SiLU(gate) * up.

On a GPU, decode streams the weights once per step and everything else should be close to free; the
unfused torch ops cost about 45 small kernels per layer. Each kernel here does one of those groups in
one launch, reading and writing each element once, with float32 math and the same rounding steps as
the torch code in `layers.py` (so float32 results agree to rounding and bfloat16 ones almost always
bit for bit).

Every launch turns Triton's FP fusion off (`NO_FP_FUSION`). With it on (Triton 3.x's default until
3.10), LLVM narrows each `bf16(f32(a) * f32(b))` to a bfloat16 multiply (exact, so harmless) and then
contracts that multiply with the add or subtract after it into one `fma.rn.bf16`: the rotary kernel
compiled for sm_90 computed `bf16(x1 * cos - bf16(x2 * sin))`, skipping the rounding of `x1 * cos`
that torch's separate multiply stores, and only about 81.5% of its bfloat16 outputs matched the torch
code (float16 likewise). The torch code, which rounds as transformers' Llama and Qwen3 modules do,
rounds every op's result.

Every launch grid comes from tensor shapes alone and nothing reads a device value on the host, so the
kernels can be captured in CUDA graphs. They run natively on CUDA tensors, and on CPU tensors in
Triton's interpreter when TRITON_INTERPRET=1 is set before this module is imported (slow: for tests).
`layers.py` imports this module only when it decides to use it, so importing llmserve needs no Triton.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from llmserve import pdl


def available(tensor: torch.Tensor) -> bool:
    """Whether the kernels can run on `tensor`: natively on CUDA, or in the interpreter."""
    return tensor.is_cuda or os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


# ---- kernels ------------------------------------------------------------------------------------


@triton.jit
def rounded(x, dtype: tl.constexpr):
    """x (float32) rounded to `dtype` and back: where the torch code stores an intermediate."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    inner_rows, stride_x_outer, stride_x_inner, stride_residual, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per row. Rows of x are addressed as (outer, inner) so that per-head norms read
    [tokens, heads, head_dim] views of a fused projection in place; outputs are contiguous rows."""
    pdl.wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    outer = row // inner_rows
    inner = row % inner_rows
    dtype = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + outer * stride_x_outer + inner * stride_x_inner + cols, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = rounded(x + residual.to(tl.float32), dtype)  # the new residual stream, as torch's add stores it
        tl.store(residual_out_ptr + row * n_cols + cols, x.to(dtype), mask=mask)
    mean_square = tl.sum(x * x, axis=0) / n_cols
    normed = rounded(x * tl.math.rsqrt(mean_square + eps), dtype)  # cast before the scale, as the reference
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (normed * weight).to(dtype), mask=mask)


@triton.jit
def rotated_halves(
    in_ptr, stride_in_head, cos, sin, dtype: tl.constexpr,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    """Rotate-half on every head of one token: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin], as the two
    halves [HEADS_PAD, HALF_PAD] in `dtype`."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    first = in_ptr + heads * stride_in_head + dims
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    # each product and sum rounded to the tensor's dtype, as the torch ops store them (NO_FP_FUSION keeps
    # the compiler from contracting a product and the sum into one multiply-add)
    out1 = rounded(x1 * cos, dtype) - rounded(x2 * sin, dtype)
    out2 = rounded(x2 * cos, dtype) + rounded(x1 * sin, dtype)
    return out1.to(dtype), out2.to(dtype)


@triton.jit
def rotate_heads(
    in_ptr, out_ptr, stride_in_head, stride_out_head, cos, sin,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    """`rotated_halves` of one token's heads, stored at out_ptr (which may be in_ptr)."""
    out1, out2 = rotated_halves(in_ptr, stride_in_head, cos, sin, out_ptr.dtype.element_ty,
                                NUM_HEADS, HEADS_PAD, HALF, HALF_PAD)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    out_first = out_ptr + heads * stride_out_head + dims
    tl.store(out_first, out1, mask=mask)
    tl.store(out_first + HALF, out2, mask=mask)


@triton.jit
def rotary_cos_sin(positions_ptr, token, cos_ptr, sin_ptr, stride_cache, dtype: tl.constexpr,
                   HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """The token's cos and sin rows [1, HALF_PAD], rounded to `dtype` as the torch code casts them."""
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF_PAD)[None, :]
    in_half = dims < HALF
    cos = rounded(tl.load(cos_ptr + position * stride_cache + dims, mask=in_half, other=0.0), dtype)
    sin = rounded(tl.load(sin_ptr + position * stride_cache + dims, mask=in_half, other=0.0), dtype)
    return cos, sin


@triton.jit
def rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head,
    stride_q_out_token, stride_q_out_head, stride_k_out_token, stride_k_out_head, stride_cache,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per token: its cos/sin row is read once and applied to all its q and k heads."""
    pdl.wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    cos, sin = rotary_cos_sin(positions_ptr, token, cos_ptr, sin_ptr, stride_cache, q_out_ptr.dtype.element_ty,
                              HALF, HALF_PAD)
    rotate_heads(q_ptr + token * stride_q_token, q_out_ptr + token * stride_q_out_token, stride_q_head,
                 stride_q_out_head, cos, sin, NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD)
    rotate_heads(k_ptr + token * stride_k_token, k_out_ptr + token * stride_k_out_token, stride_k_head,
                 stride_k_out_head, cos, sin, NUM_K_HEADS, K_HEADS_PAD, HALF, HALF_PAD)


@triton.jit
def silu_times(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in `dtype`, from float32 gate and up, rounded where the torch code stores (also the
    epilogue of `triton_linear`'s fused gate/up projection, which must give the same bits)."""
    activated = rounded(gate / (1.0 + tl.exp(-gate)), dtype)
    return (activated * up).to(dtype)


@triton.jit
def silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_gate_up, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (token, column block): out = silu(gate) * up, gate and up the two halves of a row."""
    pdl.wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    row = gate_up_ptr + token * stride_gate_up
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * n_cols + cols, silu_times(gate, up, dtype), mask=mask)


# ---- torch-facing wrappers ----------------------------------------------------------------------

# Compile options of every launch: no multiply-add contraction, so each rounding of an intermediate to
# the tensor's dtype happens where the torch code's separate op stores it (see the module docstring).
NO_FP_FUSION = {"enable_fp_fusion": False}
SILU_BLOCK = 512  # columns per program: several programs per row even for one decode token


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _norm_warps(block: int) -> int:
    return min(16, max(1, block // 256))  # about 8 elements (16 bytes of bf16) per thread


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x ([rows, n] or [tokens, heads, n], which may be a strided
    view); returns a new contiguous tensor of x's dtype."""
    x = _last_dim_contiguous(x)
    n = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.dim() == 3:
        inner_rows, stride_outer, stride_inner = x.shape[1], x.stride(0), x.stride(1)
    else:
        x = x if x.dim() == 2 else x.reshape(-1, n)
        inner_rows, stride_outer, stride_inner = 1, x.stride(0), 0
    rows = out.numel() // n if n else 0
    if rows:
        block = _next_pow2(n)
        rms_norm_kernel[(rows,)](
            x, x, weight, out, out, inner_rows, stride_outer, stride_inner, 0, n, eps,
            HAS_RESIDUAL=False, BLOCK=block, num_warps=_norm_warps(block), **NO_FP_FUSION, **pdl.launch_options(x),
        )
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for [rows, n] tensors, in one pass; both new tensors."""
    x, residual = _last_dim_contiguous(x), _last_dim_contiguous(residual)
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    new_residual = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows:
        block = _next_pow2(n)
        rms_norm_kernel[(rows,)](
            x, residual, weight, out, new_residual, 1, x.stride(0), 0, residual.stride(0), n, eps,
            HAS_RESIDUAL=True, BLOCK=block, num_warps=_norm_warps(block), **NO_FP_FUSION, **pdl.launch_options(x),
        )
    return out, new_residual


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding of q [T, H, D] and k [T, KVH, D] (strided views allowed) at
    `positions` [T], with float32 caches [max_positions, D/2]. In place (returning q and k themselves)
    or into new contiguous tensors."""
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    half = head_dim // 2
    q_out = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens:
        rotary_kernel[(tokens,)](
            positions, q, k, cos_cache, sin_cache, q_out, k_out,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_cache.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads, Q_HEADS_PAD=_next_pow2(num_q_heads),
            K_HEADS_PAD=_next_pow2(num_k_heads), HALF=half, HALF_PAD=_next_pow2(half), num_warps=4,
            **NO_FP_FUSION, **pdl.launch_options(q),
        )
    return q_out, k_out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] (gate first, as the fused projection stores them) -> [T, I]."""
    gate_up = _last_dim_contiguous(gate_up)
    tokens, width = gate_up.shape
    n = width // 2
    out = torch.empty((tokens, n), dtype=gate_up.dtype, device=gate_up.device)
    if tokens and n:
        silu_and_mul_kernel[(tokens, triton.cdiv(n, SILU_BLOCK))](
            gate_up, out, gate_up.stride(0), n, BLOCK=SILU_BLOCK, num_warps=4, **NO_FP_FUSION,
            **pdl.launch_options(gate_up),
        )
    return out
