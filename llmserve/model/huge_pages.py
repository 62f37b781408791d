"""A CPU model's weights on transparent huge pages, and its KV cache in zero pages mapped as they are touched
(`zero_mapped`): CPU memory in anonymous mappings of our own.

A decode step streams every weight once. With 4 KiB pages that stream crosses a page every 4 KiB, and each
crossing can cost a TLB miss, whose page walk is two-level on a virtual machine. Copied into one anonymous
mapping advised MADV_HUGEPAGE, the weights sit on 2 MiB pages where the kernel can supply them: on the
2-core Zen 3 VM the one-call decode step of the `medium` model took 26-27 ms instead of 29-31 ms
(BENCHMARKS.md, issue 18).

This applies where /sys/kernel/mm/transparent_hugepage/enabled is `madvise` (the common default): with
`always` torch's large allocations get huge pages already, with `never` none can be had. LLMSERVE_HUGE_PAGES=0
leaves the weights where they were loaded (for comparisons).
"""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path

import torch
from torch import nn

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ENV = "LLMSERVE_HUGE_PAGES"
ALIGN = 4096  # each tensor starts on a page (and a cache line)


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), or None where it is unknown."""
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return None
    chosen = [word for word in text.split() if word.startswith("[")]
    return chosen[0].strip("[]") if chosen else None


def applies() -> bool:
    """Whether `move_parameters` would move anything: the kernel advises huge pages only where asked, and the
    switch is not off."""
    return os.environ.get(ENV, "1") != "0" and thp_mode() == "madvise" and hasattr(mmap, "MADV_HUGEPAGE")


def zero_mapped(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in an anonymous mapping of its own: the kernel supplies zero-filled pages as they
    are first touched, so neither the time to write the zeros nor their memory is spent up front."""
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    arena = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(arena, dtype=torch.uint8)[:size].view(dtype).view(shape)


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def move_parameters(module: nn.Module) -> mmap.mmap | None:
    """Copy every contiguous CPU parameter of `module` into one mapping advised MADV_HUGEPAGE and point the
    parameters at their copies (tied parameters stay tied: each is copied once). Returns the mapping (the
    parameters' tensors keep it alive), or None where `applies()` is false or there is nothing to move."""
    params = [p for p in module.parameters() if p.device.type == "cpu" and p.is_contiguous() and p.numel() > 0]
    if not applies() or not params:
        return None
    arena = mmap.mmap(-1, sum(_aligned(p.numel() * p.element_size()) for p in params),
                      flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE)  # before the first write: pages are allocated huge as they fault in
    raw = torch.frombuffer(arena, dtype=torch.uint8)
    offset = 0
    with torch.no_grad():
        for param in params:
            size = param.numel() * param.element_size()
            copy = raw[offset : offset + size].view(param.dtype).view(param.shape)
            copy.copy_(param.data)
            param.data = copy
            offset += _aligned(size)
    return arena
