"""The decoder's elementwise groups for decode-sized bf16 batches on CPU: csrc/elementwise_bf16_cpu.c.

The same four functions as the Triton `fused_kernels` (residual add + RMSNorm, RMSNorm, rotary embedding of
q and k together, SiLU(gate) * up), with the same rounding steps as the torch code in `layers.py`.
`layers.fused_kernels_for` picks this module for CPU bf16 tensors of at most `cpu_linear.max_rows()` tokens,
where a decode step's per-op dispatch (about 40 small torch ops per layer) costs more than the arithmetic.
Off with LLMSERVE_CPU_KERNELS=0 or LLMSERVE_FUSED_KERNELS=0.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from llmserve.model import cpu_linear, native

SOURCE = Path(__file__).with_name("csrc") / "elementwise_bf16_cpu.c"
MAX_WIDTH = 16384  # the kernel's longest row (MAX_N in the C source)

_c_long = ctypes.c_long
_ptr = ctypes.c_void_p
_int = ctypes.c_int


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, built on first use; None when it cannot be built or kernels are off."""
    lib = native.load_library(SOURCE)
    if lib is None:
        return None
    lib.llmserve_rms_norm_bf16.argtypes = [_ptr] * 3 + [_int] * 2 + [_c_long] * 2 + [_int, ctypes.c_float]
    lib.llmserve_add_rms_norm_bf16.argtypes = [_ptr] * 5 + [_int] * 2 + [ctypes.c_float]
    lib.llmserve_rotary_bf16.argtypes = [_ptr] * 5 + [_int] * 4 + [_c_long] * 4
    lib.llmserve_silu_and_mul_bf16.argtypes = [_ptr] * 2 + [_int] * 2 + [_c_long]
    for fn in (lib.llmserve_rms_norm_bf16, lib.llmserve_add_rms_norm_bf16, lib.llmserve_rotary_bf16,
               lib.llmserve_silu_and_mul_bf16):
        fn.restype = None
    return lib


def fits(x: torch.Tensor) -> bool:
    """Whether x is a decode-sized bf16 CPU activation ([tokens, ...], rows no wider than MAX_WIDTH)."""
    return (
        x.dtype == torch.bfloat16 and x.device.type == "cpu" and 0 < x.shape[0] <= cpu_linear.max_rows()
        and x.shape[-1] <= MAX_WIDTH and load() is not None
    )


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x ([rows, n] or [tokens, heads, n], possibly a strided view);
    a new contiguous tensor."""
    x = _last_dim_contiguous(x)
    n = x.shape[-1]
    if x.dim() == 3:
        outer, inner, stride_outer, stride_inner = x.shape[0], x.shape[1], x.stride(0), x.stride(1)
    else:
        x = x if x.dim() == 2 else x.reshape(-1, n)
        outer, inner, stride_outer, stride_inner = x.shape[0], 1, x.stride(0), 0
    out = torch.empty(x.shape, dtype=x.dtype)
    load().llmserve_rms_norm_bf16(x.data_ptr(), weight.data_ptr(), out.data_ptr(), outer, inner, stride_outer,
                                  stride_inner, n, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for [rows, n] tensors; both new tensors."""
    x, residual = x.contiguous(), residual.contiguous()
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype)
    new_residual = torch.empty((rows, n), dtype=x.dtype)
    load().llmserve_add_rms_norm_bf16(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                      new_residual.data_ptr(), rows, n, eps)
    return out, new_residual


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
    inplace: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding of q [T, H, D] and k [T, KVH, D] (strided views allowed) at
    `positions` [T], with float32 caches [max_positions, D/2], in place (as `layers` calls it)."""
    assert inplace, "the CPU kernel rotates in place"
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    positions = positions.to(torch.int64).contiguous()
    tokens, heads, dim = q.shape
    load().llmserve_rotary_bf16(
        q.data_ptr(), k.data_ptr(), positions.data_ptr(), cos_cache.contiguous().data_ptr(),
        sin_cache.contiguous().data_ptr(), tokens, heads, k.shape[1], dim, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1),
    )
    return q, k


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] (gate first, as the fused projection stores them) -> [T, I]."""
    gate_up = _last_dim_contiguous(gate_up)
    tokens, width = gate_up.shape
    out = torch.empty((tokens, width // 2), dtype=gate_up.dtype)
    load().llmserve_silu_and_mul_bf16(gate_up.data_ptr(), out.data_ptr(), tokens, width // 2, gate_up.stride(0))
    return out
