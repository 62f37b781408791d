"""Programmatic dependent launch (PDL, compute capability 9.0 and later) for the Triton kernels of a step.

A batch-1 decode step of an 8B model is about 300 kernels, most of them a few microseconds long, so
each one's launch and ramp-up, and the tail of the one before it, are a measurable share of the step.
With PDL a kernel is launched while the kernel before it still runs. Until it waits
(`griddepcontrol.wait`: the kernel before it has finished and its writes are visible) it only gets
ready: its launch and its programs' placement overlap the end of the kernel before. Every kernel here
waits before it reads or writes memory, and then lets the next one launch
(`griddepcontrol.launch_dependents`). A kernel that does neither, such as a torch op, is simply waited
for in full, so the chain stays ordered whatever runs in it.

On an H200 (8B shape, batch 1, CUDA graphs) it took 0.9% off a bf16 step and 1.4% off an fp8 one. Having
the linears ask L2 for their first weights before the wait made both steps 7% slower instead
(BENCHMARKS.md, issue 18, ninth session), so nothing is read before the wait.

On unless LLMSERVE_PDL=0 (read once at import; benchmarks set `enabled`). The kernels launch with PDL
on NVIDIA GPUs of capability 9.0 and later, when Triton can launch that way; elsewhere they run as before.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENV = "LLMSERVE_PDL"


def _setting_from_env() -> bool:
    value = os.environ.get(ENV, "1").strip().lower()
    if value in ("0", "false", "off", "no"):
        return False
    if value in ("", "1", "true", "on", "yes"):
        return True
    raise ValueError(f"{ENV} must be 1 or 0 (got {value!r})")


enabled: bool = _setting_from_env()


@functools.cache
def _device_supports(index: int) -> bool:
    if torch.version.hip is not None:  # a ROCm torch reports its GPUs as CUDA devices too
        return False
    from triton.backends.nvidia.compiler import CUDAOptions  # noqa: PLC0415 (Triton's NVIDIA backend only)

    return torch.cuda.get_device_capability(index)[0] >= 9 and "launch_pdl" in CUDAOptions.__dataclass_fields__


def launch_options(t: torch.Tensor) -> dict[str, bool]:
    """Keyword arguments for a launch of one of the kernels here on t's device: the kernels' `PDL`
    constexpr and, where it is on, Triton's `launch_pdl`."""
    if enabled and t.is_cuda:
        index = torch.cuda.current_device() if t.device.index is None else t.device.index
        if _device_supports(index):
            return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Where PDL is on: wait until the kernel before has finished, then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
