"""A checkpoint's weight stream in one canonical layout for the quantized linear layers.

Whatever the source -- full-precision weights to quantize at load, or any supported pre-quantized layout
(see `config`) -- each quantized linear module comes out as `<module>.weight` (int8 or e4m3, [out, in])
and `<module>.weight_scale` (float32, [out]), so the model's own loader places them like any other
tensor, shard by shard into its fused matrices. Per-tensor scales become per-channel by repetition
(exact); block scales are folded in and the weight requantized per channel (not exact: one more
rounding). Activation and KV-cache scales are dropped (see `config`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from llmserve.errors import ModelLoadError
from llmserve.model.quantization.config import QuantizationConfig
from llmserve.model.quantization.fp8 import dequantize_blocks

Weights = Iterable[tuple[str, torch.Tensor]]
Quantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]

_DROPPED = ("input_scale", "output_scale", "k_scale", "v_scale", "kv_scale")
_SCALE_NAMES = ("weight_scale", "weight_scale_inv")
_PACKED_OFFSET = 128  # pack-quantized stores each int8 value + 128 as one byte of an int32


def canonical_weights(
    weights: Weights, qconfig: QuantizationConfig, targets: set[str], quantize: Quantizer, weight_dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`targets`: the quantized linear modules' checkpoint names, without a "model." prefix. A
    pre-quantized module's pieces may arrive in any order (and from different files): each is held until
    its weight and scale are both there."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        if qconfig.prequantized and leaf in _DROPPED:  # e.g. q_proj.input_scale, self_attn.k_scale
            continue
        if module.removeprefix("model.") not in targets or leaf == "bias":
            yield name, tensor
        elif not qconfig.prequantized:
            yield from _quantized_at_load(name, module, leaf, tensor, quantize)
        else:
            parts = pending.setdefault(module, {})
            parts[leaf] = tensor
            complete = _from_checkpoint(module, parts, qconfig, quantize, weight_dtype)
            if complete is not None:
                del pending[module]
                yield from complete
    if pending:
        module, parts = next(iter(pending.items()))
        raise ModelLoadError(
            f"The quantized checkpoint has an incomplete layer {module!r} (only {', '.join(sorted(parts))}); "
            "each needs its weight and weight_scale (or weight_scale_inv)."
        )


def _quantized_at_load(
    name: str, module: str, leaf: str, tensor: torch.Tensor, quantize: Quantizer
) -> Iterator[tuple[str, torch.Tensor]]:
    if leaf != "weight":
        yield name, tensor  # not ours to place: the model's loader reports it
        return
    if not tensor.dtype.is_floating_point or tensor.element_size() < 2:
        raise ModelLoadError(
            f"{name} is {tensor.dtype}, not a full-precision weight, but config.json has no quantization_config "
            "saying how it was quantized."
        )
    q, scale = quantize(tensor)
    yield name, q
    yield f"{module}.weight_scale", scale


def _from_checkpoint(
    module: str, parts: dict[str, torch.Tensor], qconfig: QuantizationConfig, quantize: Quantizer,
    weight_dtype: torch.dtype,
) -> list[tuple[str, torch.Tensor]] | None:
    scale = next((parts[n] for n in _SCALE_NAMES if n in parts), None)
    weight = _weight(parts)
    if scale is None or weight is None:
        return None
    if weight.dtype != weight_dtype:
        raise ModelLoadError(
            f"{module}.weight is {weight.dtype} in a checkpoint quantized to {qconfig.method} ({weight_dtype} expected)."
        )
    rows = weight.shape[0]
    if qconfig.block_size is not None:
        weight, per_row = quantize(dequantize_blocks(weight, scale, qconfig.block_size))
    elif scale.numel() == 1:
        per_row = scale.float().reshape(1).repeat(rows)
    elif scale.numel() == rows:
        per_row = scale.float().reshape(rows)
    else:
        raise ModelLoadError(
            f"{module} has a weight scale of shape {tuple(scale.shape)}; per-tensor or per-output-channel "
            f"scales ({rows}) are supported, or block scales with weight_block_size."
        )
    return [(f"{module}.weight", weight), (f"{module}.weight_scale", per_row)]


def _weight(parts: dict[str, torch.Tensor]) -> torch.Tensor | None:
    if "weight" in parts:
        return parts["weight"]
    if "weight_packed" in parts and "weight_shape" in parts:
        return unpack_int8(parts["weight_packed"], parts["weight_shape"])
    return None


def unpack_int8(packed: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """compressed-tensors pack-quantized, 8 bits: four values per int32, value i of a word in its byte i
    (little-endian), each stored as the unsigned value + 128; rows padded to whole words."""
    if packed.dtype != torch.int32:
        raise ModelLoadError(f"pack-quantized weights must be int32, got {packed.dtype}.")
    rows, cols = (int(v) for v in shape.tolist())
    as_bytes = packed.contiguous().view(torch.uint8)[:rows, :cols]
    return (as_bytes.to(torch.int16) - _PACKED_OFFSET).to(torch.int8)
