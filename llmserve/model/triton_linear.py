"""Decode-sized linear layers on CUDA, in Triton: out[M, N] = (x[M, K] @ w[N, K]^T) * scale[N] + bias[N]
for M up to MAX_ROWS, with bf16/fp16, int8 or fp8 (e4m3) weights, written to stream the weights once at
the device's read bandwidth.

A batch-1 decode step does two flops per weight it reads, so its linear layers are a matter of moving
bytes. Each program owns BLOCK_N weight rows (output columns) and walks K in BLOCK_K slices, loading
each weight tile with 16-byte accesses along its contiguous rows and converting it to float32 in
registers (bf16, fp16, int8 and e4m3 all convert exactly). One row of x is multiplied in on the CUDA
cores and the products summed along K once, after the loop; two to MAX_ROWS rows go through `tl.dot`
with x padded to 16 rows. There is no split-K: BLOCK_N is small enough that even N = 4096 gives several
programs per multiprocessor, which keeps enough loads in flight. int8 and e4m3 weights read half the
bytes of bf16 ones: weight-only quantization (W8A16) is what pays at batch 1, where quantizing the
activations too (fp8 `_scaled_mm`) adds kernels and saves nothing.

`normed_linear` also runs the RMSNorm before a one-row projection (with the residual stream's add) in the
projection's launch: every program computes the row's mean square itself and normalises each slice of x as it
multiplies it in, with the norm kernel's roundings, so a decoder layer launches no norm kernel of its own.

The tile shapes per weight kind, and per weight shape where one does better, were chosen on an H200
(`benchmarks/gpu_linear.py`, BENCHMARKS.md); `config_for` is the one place that picks them. Launch grids depend on shapes alone (CUDA graphs).
Runs on CPU tensors in Triton's interpreter when TRITON_INTERPRET=1 is set before import (tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmserve import pdl
from llmserve.model import fused_kernels

MAX_ROWS = 16  # past this the layers are compute-heavy enough for the library GEMMs


@dataclass(frozen=True)
class TileConfig:
    """A program's tiles. `unroll`, `vector` and `split_k` shape the one-row kernel only: `unroll` BLOCK_K
    slices are loaded before any is summed (more weight bytes in flight for the same accumulator registers),
    `vector` is the weight elements a thread loads at once (8 lines 1-byte weights up with x's 16-byte
    loads of bf16, so x's slice needs no reshuffle through shared memory and its barriers), and `split_k`
    cuts K into that many runs, one program each (more, shorter programs for a small layer)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 1
    unroll: int = 1
    vector: int = 16
    split_k: int = 1


@triton.jit
def _as_float32(w):
    """Weights to float32, exactly. int8 goes through the float bits of 2^23 + (q + 128) and one subtraction:
    integer and add units at full rate, where a conversion instruction (I2F) runs at a quarter of it: with
    one I2F per weight (SASS) the 8B shape's int8 decode linears had a 1.7 ms floor against 2.5 ms measured
    on an H200. With this form the step's int8 linears took 2.88 ms against 3.00 (H200, same tiles): the
    1-byte kernels follow their instruction count rather than one slow unit (e4m3 made float32 by integer
    operations, twice the instructions of `cvt`, was 24% slower), so fp8 keeps the conversion instruction."""
    if w.dtype == tl.int8:
        biased = (w.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x80) | 0x4B000000
        return biased.to(tl.float32, bitcast=True) - 8388736.0
    return w.to(tl.float32)


@triton.jit
def _inverse_rms(x_ptr, residual_ptr, residual_out_ptr, K, eps, ks, dtype: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr):
    """1 / rms(x + residual) over the row of K, as `fused_kernels.rms_norm_kernel` computes it; with a residual,
    the first program also stores the new residual stream x + residual (rounded as torch's add stores it)."""
    squares = tl.zeros([BLOCK_K], dtype=tl.float32)
    is_first = tl.program_id(0) + tl.program_id(1) == 0
    first = (tl.zeros([BLOCK_K], dtype=tl.int32) + is_first.to(tl.int32)) != 0  # a tensor: the interpreter wants one
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + ks < K
        x = tl.load(x_ptr + k0 + ks, mask=k_mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x = fused_kernels.rounded(x + tl.load(residual_ptr + k0 + ks, mask=k_mask, other=0.0).to(tl.float32), dtype)
            tl.store(residual_out_ptr + k0 + ks, x.to(dtype), mask=k_mask & first)
        squares += x * x
    return tl.math.rsqrt(tl.sum(squares, axis=0) / K + eps)


@triton.jit
def _row_slice(x_ptr, residual_ptr, norm_w_ptr, offsets, k_mask, inv_rms, dtype: tl.constexpr, NORM: tl.constexpr,
               HAS_RESIDUAL: tl.constexpr):
    """The row's slice at `offsets` in float32: x itself, or with NORM norm(x + residual) * norm weight, with
    the norm kernel's roundings (the norm, then the weight's product, each stored in `dtype`)."""
    x = tl.load(x_ptr + offsets, mask=k_mask, other=0.0).to(tl.float32)
    if NORM:
        if HAS_RESIDUAL:
            x = fused_kernels.rounded(x + tl.load(residual_ptr + offsets, mask=k_mask, other=0.0).to(tl.float32), dtype)
        norm_w = tl.load(norm_w_ptr + offsets, mask=k_mask, other=0.0).to(tl.float32)
        x = fused_kernels.rounded(fused_kernels.rounded(x * inv_rms, dtype) * norm_w, dtype)
    return x


@triton.jit
def gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, N, K, stride_wn,
    norm_w_ptr, residual_ptr, residual_out_ptr, eps, partial_ptr, arrived_ptr,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UNROLL: tl.constexpr, VECTOR: tl.constexpr, SWIGLU: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    SPLIT_K: tl.constexpr, PDL: tl.constexpr,
):
    """One row of x (contiguous) against BLOCK_N weight rows; out is one contiguous row. With SWIGLU the
    weight is a fused gate/up projection (N rows: the gate's, then the up's) and out is silu(gate) * up,
    N / 2 wide: a program takes the same BLOCK_N / 2 rows of each half and pairs them at the end (two blocks
    of rows compile to the K loop of one; interleaved rows cost it instructions and loads in flight).
    With NORM the row multiplied in is RMSNorm(x (+ residual)) * norm_w, which every program computes for
    itself (a pass over the row from L2 for its mean square), in place of a norm kernel's launch.
    With SPLIT_K > 1, program (i, s) sums run s of K's SPLIT_K runs into `partial_ptr` [SPLIT_K, N]
    (float32) and counts itself in `arrived_ptr[i]`; the last of row block i to arrive adds the runs in
    order (the same bits whichever that is), finishes the rows and sets the count back to 0 for the next call."""
    if SWIGLU:
        pairs = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N) % (BLOCK_N // 2)
        cols = pairs + (tl.arange(0, BLOCK_N) // (BLOCK_N // 2)) * (N // 2)  # gate rows, then up rows
        col_mask = pairs < N // 2
    else:
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
    pdl.wait_for_inputs(PDL)
    dtype = out_ptr.dtype.element_ty
    ks = tl.max_contiguous(tl.arange(0, BLOCK_K), VECTOR)
    inv_rms = 1.0
    if NORM:
        inv_rms = _inverse_rms(x_ptr, residual_ptr, residual_out_ptr, K, eps, ks, dtype, BLOCK_K, HAS_RESIDUAL)
    k_begin, k_end = 0, K  # one run: the loop's bounds as the compiler best knows them
    if SPLIT_K > 1:
        run = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K * UNROLL) * (BLOCK_K * UNROLL)  # whole passes of the loop a run
        k_begin = tl.program_id(1) * run
        k_end = tl.minimum(k_begin + run, K)
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for start in range(k_begin, k_end, BLOCK_K * UNROLL):
        for part in tl.static_range(UNROLL):
            k0 = start + part * BLOCK_K
            k_mask = k0 + ks < k_end
            w = tl.load(w_ptrs + k0, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
            x = _row_slice(x_ptr, residual_ptr, norm_w_ptr, k0 + ks, k_mask, inv_rms, dtype, NORM, HAS_RESIDUAL)
            acc += _as_float32(w) * x[None, :]
    out = tl.sum(acc, axis=1)
    if SPLIT_K == 1:
        _finish_rows(out, cols, col_mask, scale_ptr, bias_ptr, out_ptr, N, dtype, HAS_SCALE, HAS_BIAS, SWIGLU,
                     BLOCK_N)
    else:
        tl.store(partial_ptr + tl.program_id(1) * N + cols, out, mask=col_mask)
        tl.debug_barrier()  # every thread's partial stored before the count says so
        arrived = tl.atomic_add(arrived_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # from L2 (.cg): other programs' stores are not in this L1
                total += tl.load(partial_ptr + s * N + cols, mask=col_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(arrived_ptr + tl.program_id(0), 0, sem="relaxed", scope="gpu")
            _finish_rows(total, cols, col_mask, scale_ptr, bias_ptr, out_ptr, N, dtype, HAS_SCALE, HAS_BIAS, SWIGLU,
                         BLOCK_N)


@triton.jit
def _finish_rows(out, cols, col_mask, scale_ptr, bias_ptr, out_ptr, N, dtype: tl.constexpr, HAS_SCALE: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_N: tl.constexpr):
    """The row block's sums (float32) times the row scales, plus the bias, stored in `dtype` (with SWIGLU as
    silu(gate) * up)."""
    if HAS_SCALE:
        out = out * tl.load(scale_ptr + cols, mask=col_mask, other=0.0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if SWIGLU:  # gate and up rounded as the projection would store them, then SiLU-and-multiply's own steps
        gate, up = tl.split(tl.trans(tl.reshape(out.to(dtype).to(tl.float32), [2, BLOCK_N // 2])))
        outs = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_ptr + outs, fused_kernels.silu_times(gate, up, dtype), mask=outs < N // 2)
    else:
        tl.store(out_ptr + cols, out.to(dtype), mask=col_mask)


@triton.jit
def small_m_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """Up to 16 rows of x against BLOCK_N weight rows, through tl.dot (x padded to 16 rows)."""
    rows = tl.arange(0, 16)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    pdl.wait_for_inputs(PDL)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k_mask = start + ks < K
        x = tl.load(x_ptrs + start, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + start, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee")
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


# (weight kind, one row or more) -> tiles, from the sweep of benchmarks/gpu_linear.py on an H200 (BENCHMARKS.md,
# issue 18). bf16 at one row: 4 rows x 2,048 columns a program (16 KB of weights a pass, 128 B a thread in
# flight) read the 8B shape's decode linears at 95% of copy bandwidth, cuBLAS at 89%; at 2-16 rows cuBLAS
# wins and "auto" leaves bf16 to it. int8 at one row: 16 x 512 with 8 warps, 2.63 ms for the step's linears
# against 2.85 for 4 x 1,024 (second sweep, 2026-11-27).
_CONFIGS: dict[tuple[str, bool], TileConfig] = {
    ("16-bit", True): TileConfig(block_n=4, block_k=2048, num_warps=4),
    ("int8", True): TileConfig(block_n=16, block_k=512, num_warps=8),
    ("fp8", True): TileConfig(block_n=8, block_k=1024, num_warps=4),
    ("16-bit", False): TileConfig(block_n=32, block_k=128, num_warps=4, num_stages=4),
    ("int8", False): TileConfig(block_n=32, block_k=256, num_warps=4, num_stages=4),
    ("fp8", False): TileConfig(block_n=32, block_k=256, num_warps=4, num_stages=4),
}


def weight_kind(weight: torch.Tensor) -> str:
    if weight.dtype == torch.int8:
        return "int8"
    return "fp8" if weight.element_size() == 1 else "16-bit"  # float32 weights: tests in the interpreter


# One-row tiles for the weight shapes where the sweep (`gpu_linear.py --rows 1`, H200, 2026-11-28) found some
# at least 5% faster than the kind's own: (kind, N, K) -> tiles. The 8B shape's fp8 linears of a decode step
# took 2.28 ms with these against 2.45 with one tile for all (BENCHMARKS.md, issue 18, ninth session).
_SHAPE_CONFIGS: dict[tuple[str, int, int], TileConfig] = {
    ("fp8", 6144, 4096): TileConfig(block_n=16, block_k=512, num_warps=8),  # Llama-3 8B qkv_proj
    ("fp8", 28672, 4096): TileConfig(block_n=16, block_k=256, num_warps=4),  # gate_up_proj
    ("fp8", 128256, 4096): TileConfig(block_n=4, block_k=1024, num_warps=4, unroll=4, vector=8),  # lm_head
    ("int8", 4096, 4096): TileConfig(block_n=8, block_k=1024, num_warps=4),  # o_proj
    ("int8", 4096, 14336): TileConfig(block_n=8, block_k=1024, num_warps=4),  # down_proj
}


def config_for(weight: torch.Tensor, rows: int) -> TileConfig:
    kind = weight_kind(weight)
    if rows == 1 and (tuned := _SHAPE_CONFIGS.get((kind, *weight.shape))) is not None:
        return tuned
    return _CONFIGS[(kind, rows == 1)]


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes x [M, K]: few enough rows, a 16-bit activation dtype, contiguous weight rows."""
    return (
        x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
        and weight.stride(1) == 1 and x.device == weight.device
    )


def linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
    config: TileConfig | None = None, swiglu: bool = False,
) -> torch.Tensor:
    """x [M, K] times `weight` [N, K] (x's dtype, int8 or float8_e4m3fn), times the float32 per-row
    `scale` [N] when given, plus `bias` [N]; x's dtype out. `config` overrides the tiles (benchmarks).
    `swiglu` (one row of x only): `weight` is a fused gate/up projection and the result is
    silu(gate) * up [1, N / 2], in the same launch."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _launch(x, weight, scale, bias, config, swiglu, None)


@dataclass(frozen=True)
class FoldedNorm:
    """An RMSNorm run inside a one-row projection's launch: its weight and eps, and the residual stream added to
    the row first (None: the row is the stream itself)."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None


def normed_linear(
    x: torch.Tensor, norm: FoldedNorm, weight: torch.Tensor, scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None, config: TileConfig | None = None, swiglu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`linear` of RMSNorm(x + norm.residual) * norm.weight, the new residual stream x + norm.residual) for one
    row x [1, K], in one launch: what `fused_kernels.fused_add_rms_norm` (or `rms_norm` without a residual)
    then `linear` give, with the norm's launch saved. The stream is x itself without a residual."""
    x = x.contiguous()
    if x.shape[0] != 1:
        raise ValueError(f"normed_linear takes one row of x, got {x.shape[0]}")
    residual = None if norm.residual is None else norm.residual.contiguous()
    new_residual = x if residual is None else torch.empty_like(x)
    out = _launch(x, weight, scale, bias, config, swiglu, (norm.weight, norm.eps, residual, new_residual))
    return out, new_residual


def _launch(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
    config: TileConfig | None, swiglu: bool,
    norm: tuple[torch.Tensor, float, torch.Tensor | None, torch.Tensor] | None,
) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    config = config or config_for(weight, m)
    if swiglu and (m != 1 or n % 2 or config.block_n % 2):
        raise ValueError(f"swiglu takes one row of x, an even number of weight rows and even tiles, got {m}, {n}, "
                         f"{config.block_n}")
    out = torch.empty((m, n // 2 if swiglu else n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, config.block_n),)
    scale_arg = scale if scale is not None else out
    bias_arg = bias if bias is not None else out
    common = dict(HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, BLOCK_N=config.block_n,
                  BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages,
                  **pdl.launch_options(x))
    if m == 1:
        norm_w, eps, residual, new_residual = norm if norm is not None else (out, 0.0, None, out)
        partial, arrived = _split_k_buffers(x.device, n, grid[0], config.split_k) if config.split_k > 1 else (out, out)
        gemv_kernel[(grid[0], config.split_k)](
            x, weight, scale_arg, bias_arg, out, n, k, weight.stride(0),
            norm_w, residual if residual is not None else out, new_residual, eps, partial, arrived,
            UNROLL=config.unroll, VECTOR=config.vector, SWIGLU=swiglu, NORM=norm is not None,
            HAS_RESIDUAL=residual is not None, SPLIT_K=config.split_k, **common)
    else:
        small_m_kernel[grid](x, weight, scale_arg, bias_arg, out, m, n, k, x.stride(0), weight.stride(0),
                             out.stride(0), **common)
    return out


# (device, N, row blocks, splits) -> (float32 partial sums [splits, N], arrival counts [row blocks]). Reused by every
# call of that shape, which run one after another on a stream; the counts are zero between calls (the last program
# of a block resets its own), so a CUDA graph may capture a call that allocated them.
_split_k_cache: dict[tuple[torch.device, int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _split_k_buffers(device: torch.device, n: int, blocks: int, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device, n, blocks, splits)
    if key not in _split_k_cache:
        _split_k_cache[key] = (torch.empty((splits, n), dtype=torch.float32, device=device),
                               torch.zeros(blocks, dtype=torch.int32, device=device))
    return _split_k_cache[key]
