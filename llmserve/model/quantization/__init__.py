"""Quantized linear layers: int8 and fp8 weights with per-output-channel scales (see `config`).

A model is built as usual; `QuantizedLoader` then gives its `Linear` layers (all but those the
checkpoint leaves unquantized, and the lm_head unless `--quantize-lm-head`) int8 or e4m3 `weight`s,
float32 `weight_scale`s and a `quant_method` that runs their forward pass. The model's own `load_weights` fills them from the
checkpoint stream rewritten to that canonical layout (`checkpoint`), and `finalize` prepares what the
kernels want. With dummy weights the random full-precision weights are quantized in place instead.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.errors import ModelLoadError
from llmserve.model.layers import Linear
from llmserve.model.quantization.checkpoint import Weights, canonical_weights
from llmserve.model.quantization.config import QUANTIZATION_METHODS, QuantizationConfig, resolve_quantization
from llmserve.model.quantization.fp8 import Fp8LinearMethod
from llmserve.model.quantization.int8 import Int8LinearMethod

__all__ = ["QUANTIZATION_METHODS", "QuantizationConfig", "QuantizedLoader", "resolve_quantization"]

LinearMethod = Int8LinearMethod | Fp8LinearMethod


def linear_method(name: str) -> LinearMethod:
    return Int8LinearMethod() if name == "int8" else Fp8LinearMethod()


class QuantizedLoader:
    """Quantizes one model's linear layers: `load` (from a checkpoint stream) or `quantize_in_place`
    (dummy weights), then `finalize`."""

    def __init__(self, model: nn.Module, qconfig: QuantizationConfig) -> None:
        self.model = model
        self.qconfig = qconfig
        self.method = linear_method(qconfig.method)
        if not qconfig.ignores("lm_head") and getattr(model, "lm_head", False) is None:
            raise ModelLoadError(
                "--quantize-lm-head: this model's lm_head is its input embedding table (tie_word_embeddings), "
                "which stays unquantized."
            )
        self.layers = self._quantized_layers()

    def _quantized_layers(self) -> dict[str, Linear]:
        """Our Linear modules to quantize, by the checkpoint names of their shards (without "model.")."""
        fused: dict[str, tuple[str, int]] = getattr(self.model, "fused_weights", {})
        layers: dict[str, Linear] = {}
        for name, module in self.model.named_modules():
            if not isinstance(module, Linear) or not getattr(module, "quantizable", True):
                continue  # (a mixture of experts' router stays in the model dtype)
            prefix, _, leaf = name.rpartition(".")
            fragments = [f for f, (target, _) in fused.items() if target == leaf] or [leaf]
            shards = [f"{prefix}.{f}" if prefix else f for f in fragments]
            ignored = [self.qconfig.ignores(_checkpoint_name(s)) for s in shards]
            if any(ignored) and not all(ignored):
                raise ModelLoadError(
                    f"The checkpoint quantizes only some of {', '.join(shards)}, which llmserve fuses into one "
                    "matrix; quantize all of them or none."
                )
            if not any(ignored):
                layers.update(dict.fromkeys(shards, module))
        return layers

    def load(self, weights: Weights) -> None:
        """Swap in empty quantized parameters, then fill them through the model's loader."""
        for layer in set(self.layers.values()):
            out_features, in_features = layer.weight.shape
            device = layer.weight.device
            layer.weight = nn.Parameter(
                torch.empty(out_features, in_features, dtype=self.method.weight_dtype, device=device), requires_grad=False
            )
            layer.weight_scale = nn.Parameter(torch.empty(out_features, device=device), requires_grad=False)
        for experts in self._experts():
            experts.use_int8()  # each expert matrix quantized as the model's loader reads it
        stream = canonical_weights(weights, self.qconfig, set(self.layers), self.method.quantize, self.method.weight_dtype)
        self.model.load_weights(stream)

    def _experts(self) -> list[nn.Module]:
        """The model's mixtures of experts (moe.py), whose stacked experts are quantized by themselves: int8 only."""
        experts = [module for module in self.model.modules() if hasattr(module, "use_int8")]
        if experts and self.method.name != "int8":
            raise ModelLoadError(f"A mixture of experts' experts are quantized to int8 only, not {self.method.name}.")
        return experts

    @torch.no_grad()
    def quantize_in_place(self) -> None:
        for experts in self._experts():
            experts.quantize_in_place()
        for layer in set(self.layers.values()):
            q, scale = self.method.quantize(layer.weight)
            layer.weight = nn.Parameter(q, requires_grad=False)
            layer.weight_scale = nn.Parameter(scale.to(q.device), requires_grad=False)

    def finalize(self, dtype: torch.dtype) -> None:
        for layer in set(self.layers.values()):
            self.method.process_weights(layer, dtype)
            layer.quant_method = self.method


def _checkpoint_name(module: str) -> str:
    return module if module.startswith("lm_head") else f"model.{module}"
