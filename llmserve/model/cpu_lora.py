"""LoRA adapters added to bf16 rows on CPU in one call per adapted projection: csrc/lora_bf16_cpu.c (see there),
the same code the one-call decoder runs for its steps, so the per-module path's bits are its bits."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from llmserve.model import cpu_linear, native

CSRC = Path(__file__).with_name("csrc")
SOURCE = CSRC / "lora_bf16_cpu.c"
MAX_LORA_WIDTH = 1024  # MAX_LORA_WIDTH in the C source: a slot's width (shards x maximum rank) it takes
# Rows it takes: decode-sized steps (the one-call decoder's at most). Each thread shrinks every row itself, which
# costs more than a matmul per adapter once a step holds prompt chunks.
MAX_ROWS = 16

_ptr = ctypes.c_void_p
_int = ctypes.c_int


@functools.cache
def load() -> ctypes.CDLL | None:
    """The library, built on first use with the linear kernel's tuning (its shrink is that kernel's); None when
    it cannot be built or kernels are off."""
    lib = native.load_library(SOURCE, [CSRC / "linear_bf16_cpu.c"], defines=cpu_linear.tuned())
    if lib is None:
        return None
    lib.llmserve_lora_add_bf16.argtypes = [_ptr, _ptr, _int, _ptr, _ptr, _int, _int, _int, _ptr, _int, _int]
    lib.llmserve_lora_add_bf16.restype = _int
    return lib


def runs(out: torch.Tensor, width: int) -> bool:
    """Whether adapters are added to `out` ([T, n]) here: at most MAX_ROWS bf16 rows on the CPU, slots no wider
    than the C code takes, the linear kernel on."""
    return (
        out.dtype == torch.bfloat16 and out.device.type == "cpu" and out.shape[0] <= MAX_ROWS and out.is_contiguous()
        and width <= MAX_LORA_WIDTH and cpu_linear.bf16_kernel_runs() and load() is not None
    )


def add(out: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, bt: torch.Tensor) -> None:
    """out[t] += (x[t] A_s^T) B_s^T for each row t whose slot s = slots[t] is not -1 (in place); a [S, width, k]
    and bt [S, width, n] are every slot's."""
    x = x.contiguous()
    m, k = x.shape
    width, n = bt.shape[1:]
    assert out.shape == (m, n) and slots.shape == (m,) and slots.dtype == torch.int32 and a.shape[1:] == (width, k)
    status = load().llmserve_lora_add_bf16(
        x.data_ptr(), slots.data_ptr(), m, a.data_ptr(), bt.data_ptr(), width, k, n, out.data_ptr(),
        torch.get_num_threads(), cpu_linear.PATHS[cpu_linear.current_path()],
    )
    if status != 0:
        raise RuntimeError("the LoRA kernel rejected its arguments")
