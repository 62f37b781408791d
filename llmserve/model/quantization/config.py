"""Which quantization a model runs with: `--quantization`, a checkpoint's `quantization_config`, or both.

Two weight formats are supported, both symmetric with one float32 scale per output channel once loaded:

- int8: weights in [-127, 127], w ~= q * scale.
- fp8: float8 e4m3 weights, w ~= q * scale.

They come from a full-precision checkpoint quantized at load (`--quantization int8|fp8`), or from a
checkpoint already quantized in one of these layouts (config.json `quantization_config`):

- compressed-tensors (llm-compressor): `format` float-quantized (fp8) or int-quantized, naive-quantized,
  pack-quantized (int8, four values per int32); 8-bit symmetric weights with strategy channel, tensor or
  (fp8) block. Tensors `*.weight` (or `*.weight_packed` + `*.weight_shape`) and `*.weight_scale`.
- fp8 (AutoFP8, Hugging Face FineGrainedFP8): `*.weight` e4m3 with a per-tensor `*.weight_scale`, or
  with `weight_block_size` and block scales `*.weight_scale_inv`.

Activation scales (`input_scale`) and KV-cache scales in such checkpoints are read past: activations stay
in the model dtype (weight-only) or are quantized per token at run time (fp8 on GPUs with fp8 matmul).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from llmserve.errors import ModelLoadError

QUANTIZATION_METHODS = ("int8", "fp8")

SUPPORTED_CHECKPOINTS = (
    "compressed-tensors with 8-bit symmetric weights (format float-quantized for fp8; int-quantized, "
    "naive-quantized or pack-quantized for int8; strategy channel or tensor, or block for fp8), "
    "and quant_method fp8 (per-tensor weight_scale, or weight_block_size with weight_scale_inv)"
)

_CT_INT_FORMATS = ("int-quantized", "naive-quantized", "pack-quantized")
_CT_FLOAT_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(frozen=True)
class QuantizationConfig:
    method: str  # int8 | fp8
    # None: full-precision weights quantized at load; else the layout of a pre-quantized checkpoint.
    checkpoint_format: str | None = None  # compressed-tensors | fp8
    block_size: tuple[int, int] | None = None  # fp8 block scales: (output rows, input columns) per scale
    ignore: tuple[str, ...] = field(default=("lm_head",))  # checkpoint module names, or "re:" patterns

    @property
    def prequantized(self) -> bool:
        return self.checkpoint_format is not None

    def ignores(self, checkpoint_module: str) -> bool:
        """Whether the checkpoint keeps this linear module (e.g. "model.layers.0.mlp.up_proj") unquantized."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], checkpoint_module):
                    return True
            elif checkpoint_module == entry or checkpoint_module.endswith("." + entry):
                return True
        return False


def resolve_quantization(
    requested: str | None, hf_config: dict[str, Any], dummy_weights: bool, quantize_lm_head: bool = False,
) -> QuantizationConfig | None:
    """The quantization to run: the checkpoint's own when it has one (`requested` must then name the
    same method or nothing), else `requested` applied at load, the lm_head included with
    `quantize_lm_head`. With dummy weights nothing is read from the checkpoint, so its quantization is
    applied to the random weights instead."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (got {requested!r}).")
    raw = hf_config.get("quantization_config")
    checkpoint = parse_checkpoint_quantization(raw) if raw else None
    if quantize_lm_head and checkpoint is not None:
        raise ModelLoadError(
            "--quantize-lm-head applies to weights quantized at load; this checkpoint is already quantized, and its "
            "quantization_config decides which modules are."
        )
    if quantize_lm_head and requested is None:
        raise ValueError("--quantize-lm-head needs --quantization (int8 or fp8).")
    if checkpoint is None:
        return QuantizationConfig(requested, ignore=() if quantize_lm_head else ("lm_head",)) if requested else None
    if requested is not None and requested != checkpoint.method:
        raise ModelLoadError(
            f"The checkpoint is already quantized to {checkpoint.method}; --quantization {requested} cannot "
            f"apply to it (pass --quantization {checkpoint.method} or leave it out)."
        )
    if dummy_weights:
        return QuantizationConfig(checkpoint.method, ignore=checkpoint.ignore)
    return checkpoint


def parse_checkpoint_quantization(raw: dict[str, Any]) -> QuantizationConfig:
    """A config.json `quantization_config`, or ModelLoadError naming what is supported."""
    if not isinstance(raw, dict):
        raise ModelLoadError(f"quantization_config must be an object; supported: {SUPPORTED_CHECKPOINTS}.")
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        return _parse_compressed_tensors(raw)
    if method == "fp8":
        return _parse_fp8(raw)
    raise ModelLoadError(f"Checkpoint quantization {method!r} is not supported; supported: {SUPPORTED_CHECKPOINTS}.")


def _unsupported(detail: str) -> ModelLoadError:
    return ModelLoadError(f"Unsupported compressed-tensors checkpoint: {detail}. Supported: {SUPPORTED_CHECKPOINTS}.")


def _parse_compressed_tensors(raw: dict[str, Any]) -> QuantizationConfig:
    groups = raw.get("config_groups") or {}
    if not groups:
        raise _unsupported("no config_groups")
    schemes = [_compressed_tensors_scheme(raw, group) for group in groups.values()]
    if len(set(schemes)) != 1:
        raise _unsupported(f"config groups with different weight schemes {sorted(set(schemes))}")
    method, block = schemes[0]
    return QuantizationConfig(method, "compressed-tensors", block, _ignore_list(raw.get("ignore")))


def _compressed_tensors_scheme(raw: dict[str, Any], group: dict[str, Any]) -> tuple[str, tuple[int, int] | None]:
    fmt = group.get("format") or raw.get("format")
    weights = group.get("weights") or {}
    if weights.get("num_bits") != 8:
        raise _unsupported(f"{weights.get('num_bits')}-bit weights")
    if not weights.get("symmetric", True):
        raise _unsupported("asymmetric weights (zero points)")
    kind, strategy = weights.get("type", "int"), weights.get("strategy", "tensor")
    if kind == "int" and fmt in _CT_INT_FORMATS and strategy in ("channel", "tensor"):
        return "int8", None
    if kind == "float" and fmt in _CT_FLOAT_FORMATS and strategy in ("channel", "tensor"):
        return "fp8", None
    if kind == "float" and fmt in _CT_FLOAT_FORMATS and strategy == "block":
        return "fp8", _block_size(weights.get("block_structure"))
    raise _unsupported(f"{kind} weights, format {fmt!r}, strategy {strategy!r}")


def _parse_fp8(raw: dict[str, Any]) -> QuantizationConfig:
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelLoadError(f"fp8 checkpoints in format {fmt!r} are not supported; supported: {SUPPORTED_CHECKPOINTS}.")
    block = raw.get("weight_block_size")
    ignore = _ignore_list(raw.get("ignored_layers") or raw.get("modules_to_not_convert"))
    return QuantizationConfig("fp8", "fp8", _block_size(block) if block else None, ignore)


def _block_size(value: Any) -> tuple[int, int]:
    if not (isinstance(value, list | tuple) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        raise ModelLoadError(f"fp8 block scales need a block size of two positive ints, got {value!r}.")
    return int(value[0]), int(value[1])


def _ignore_list(entries: Iterable[str] | None) -> tuple[str, ...]:
    return ("lm_head", *entries) if entries else ("lm_head",)
