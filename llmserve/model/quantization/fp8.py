"""fp8 (e4m3) linear layers: symmetric weights with one scale per output channel.

On CUDA GPUs with fp8 tensor cores (compute capability 8.9+: Ada, Hopper), decode-sized inputs (up to 16
rows) run `triton_linear`'s weight-streaming kernel (W8A16: the e4m3 weights converted in registers, half
the bytes of bf16 read, no activation quantization); larger ones quantize the activations to e4m3 per
token at run time and run `torch._scaled_mm` with row-wise scales (W8A8). Elsewhere
(older GPUs, CPU) the weights are converted to the activation dtype per call and the scales applied to
the output: a weight-only emulation that is exact in its arithmetic (e4m3 -> bf16 is exact) but slow, so
it logs a warning; it exists so fp8 checkpoints still run there.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from llmserve.model.layers import triton_linear_for

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
_SCALE_FLOOR = 1e-12  # a row or token of zeros still gets a usable (positive) scale


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 per-row scale) with weight ~= q * scale[:, None]."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_(min=_SCALE_FLOOR)
    return (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_blocks(weight: torch.Tensor, block_scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 weight from e4m3 values and one scale per (block[0] x block[1]) tile (edge tiles partial)."""
    rows, cols = weight.shape
    scale = block_scale.float().repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return weight.float() * scale


def scaled_mm_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8LinearMethod:
    name = "fp8"
    weight_dtype = FP8_DTYPE

    quantize = staticmethod(quantize_fp8)

    def __init__(self) -> None:
        self._warned = False

    def process_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        weight = layer.weight
        # _scaled_mm wants K and N multiples of 16; other shapes take the emulated path.
        layer.use_scaled_mm = scaled_mm_supported(weight.device) and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0
        layer.kernel_scale = layer.weight_scale.detach().float().reshape(1, -1) if layer.use_scaled_mm else (
            layer.weight_scale.detach().to(dtype)
        )
        if not layer.use_scaled_mm and not self._warned:
            self._warned = True
            logger.warning(
                "fp8 weights on %s run as a weight-only emulation (converted to %s per call): correct but slow; "
                "fp8 matmul needs a CUDA GPU of compute capability 8.9 or newer", weight.device, dtype,
            )

    def triton_scale(self, layer: nn.Module) -> torch.Tensor | None:
        """The row scales `triton_linear` takes for this layer; None where the layer never runs there."""
        return layer.kernel_scale.view(-1) if layer.use_scaled_mm else None

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        scale = self.triton_scale(layer)
        kernels = triton_linear_for(x2, layer.weight, quantized=True) if scale is not None else None
        if kernels is not None:
            out = kernels.linear(x2, layer.weight, scale, layer.bias)
        elif layer.use_scaled_mm:
            out = _scaled_mm(x2, layer.weight, layer.kernel_scale, layer.bias)
        else:
            out = nn.functional.linear(x2, layer.weight.to(x2.dtype)) * layer.kernel_scale
            if layer.bias is not None:
                out = out + layer.bias
        return out.reshape(*shape[:-1], out.shape[-1])


def _scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] (bf16/fp16) quantized per token, times the e4m3 weight [N, K] with row scales [1, N]."""
    x_scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp_(min=_SCALE_FLOOR)
    x_fp8 = (x.float() / x_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=weight_scale, bias=bias, out_dtype=x.dtype)
