"""int8 weight-only linear layers: symmetric, one scale per output channel, activations in the model dtype.

On CPU, decode-sized bf16 inputs (up to `cpu_linear.int8_max_rows()` rows) run our C kernel
(`cpu_linear.int8_linear`): each int8 weight row streamed once, converted to bf16 exactly on the fly,
half the bytes of a bf16 GEMV. Other decode-sized inputs (float32 activations, or the kernel not built;
up to INT8_KERNEL_MAX_ROWS rows, input size a multiple of 16) run `torch._weight_int8pack_mm`, torch's
AVX-512 kernel for the same product, which costs about one GEMV per row. Larger inputs (prefill) convert
the weights and run the dtype's GEMM instead: at 256 rows of the medium model's gate_up_proj
`_weight_int8pack_mm` took 40 ms, the conversion and GEMM 16 ms (BENCHMARKS.md, issue 18). On CUDA,
with bf16/fp16 activations, decode-sized inputs (up to 16 rows) run `triton_linear`'s weight-streaming
kernel and larger ones a Triton matmul (`triton_int8`); both read the int8 weights once. The
conversion path (int8 -> bf16 is exact, the scales applied to the output) is correct everywhere but
saves memory, not time. On CPUs without native bf16 GEMM (no AVX-512), bf16 inputs above the kernel's rows
take `cpu_linear.float32_gemm` instead, as bf16 layers do there.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from llmserve.model import cpu_linear
from llmserve.model.layers import triton_linear_for

INT8_MAX = 127
INT8_KERNEL_MAX_ROWS = 8  # past this the CPU kernel is slower than converting the weights (16 rows: 2.75 vs 2.61 ms)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 per-row scale) with weight ~= q * scale[:, None]; an all-zero row gets scale 1."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


class Int8LinearMethod:
    name = "int8"
    weight_dtype = torch.int8

    quantize = staticmethod(quantize_int8)

    def process_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        """Cast the scales to the activation dtype once: the CPU kernel takes them in that dtype. The kernel
        handles input sizes that are multiples of 16 (it crashes on others, which take the generic path)."""
        layer.kernel_scale = layer.weight_scale.detach().to(dtype)
        layer.use_int8_kernel = layer.weight.device.type == "cpu" and layer.weight.shape[1] % 16 == 0
        layer.triton_int8 = _triton_int8() if layer.weight.is_cuda and dtype in (torch.bfloat16, torch.float16) else None
        if layer.triton_int8 is not None:
            layer.kernel_scale = layer.weight_scale.detach().float()  # applied to the float32 accumulator

    def triton_scale(self, layer: nn.Module) -> torch.Tensor | None:
        """The row scales `triton_linear` takes for this layer; None where the layer never runs there."""
        return layer.kernel_scale if layer.triton_int8 is not None else None

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if cpu_linear.int8_kernel_fits(x2, layer.weight):
            out = cpu_linear.int8_linear(x2, layer.weight, layer.weight_scale, layer.bias)
            return out.reshape(*shape[:-1], out.shape[-1])
        scale = self.triton_scale(layer)
        kernels = triton_linear_for(x2, layer.weight, quantized=True) if scale is not None else None
        if kernels is not None:
            return kernels.linear(x2, layer.weight, scale, layer.bias).reshape(*shape[:-1], -1)
        if layer.use_int8_kernel and x2.shape[0] <= INT8_KERNEL_MAX_ROWS:
            out = torch._weight_int8pack_mm(x2, layer.weight, layer.kernel_scale)
        elif layer.triton_int8 is not None:
            return layer.triton_int8.w8a16_matmul(x2, layer.weight, layer.kernel_scale, layer.bias).reshape(
                *shape[:-1], layer.weight.shape[0]
            )
        elif cpu_linear.float32_gemm_pays(x2):
            out = cpu_linear.float32_gemm(x2, layer.weight, layer.weight_scale, layer.bias)
            return out.reshape(*shape[:-1], out.shape[-1])
        else:
            out = nn.functional.linear(x2, layer.weight.to(x2.dtype)) * layer.kernel_scale
        if layer.bias is not None:
            out = out + layer.bias
        return out.reshape(*shape[:-1], out.shape[-1])


def _triton_int8() -> ModuleType | None:
    try:
        from llmserve.model.quantization import triton_int8
    except ImportError:
        return None
    return triton_int8
