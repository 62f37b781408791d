"""Model configuration read from a Hugging Face `config.json` (transformers 4.x and 5.x layouts)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmserve.errors import ModelLoadError

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    key = name.removeprefix("torch.").lower()
    if key not in _DTYPES:
        raise ValueError(f"Unsupported dtype {name!r}; use one of float32, bfloat16, float16 or auto.")
    return _DTYPES[key]


@dataclass
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # Qwen2-VL's multimodal rotary embedding: how many of the head's frequencies turn with each of an image token's
    # temporal, height and width position ids (None: one position id per token).
    mrope_section: tuple[int, ...] | None = None


def merged(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` over it; where both hold an object there, the two merged the same way."""
    result = dict(base)
    for key, value in overrides.items():
        inner = result.get(key)
        result[key] = merged(inner, value) if isinstance(inner, Mapping) and isinstance(value, Mapping) else value
    return result


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    dtype: torch.dtype
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        if "text_config" in cfg and "vision_config" in cfg:  # a vision-language model: its decoder's config
            config = cls.from_dict(_decoder_config(cfg))
            config.raw = cfg
            return config
        architectures = cfg.get("architectures") or []
        if not architectures:
            raise ModelLoadError("config.json names no architecture (the 'architectures' field is empty).")
        arch = architectures[0]
        model_type = cfg.get("model_type", "")
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or hidden // heads
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        # Qwen2 always has a bias on q/k/v (its config has no field for it), Qwen2-MoE unless `qkv_bias` says
        # otherwise; others say so explicitly.
        attention_bias = bool(cfg.get("attention_bias", cfg.get("qkv_bias", model_type in _QWEN2_TYPES)))
        sliding = cfg.get("sliding_window")
        if model_type in (*_QWEN2_TYPES, "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            sliding_window=int(sliding) if sliding else None,
            dtype=parse_dtype(dtype_name),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            raw=cfg,
        )

    @property
    def num_labels(self) -> int:
        """A classifier's label count: config.json keeps `id2label` (transformers writes no `num_labels`)."""
        return len(self.raw.get("id2label") or {}) or int(self.raw.get("num_labels", 2))

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, overrides: Mapping[str, Any] | None = None) -> ModelConfig:
        """The checkpoint's config.json, with `overrides` merged over it (nested objects key by key)."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir} has no config.json; is it a Hugging Face model directory?")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
        try:
            return cls.from_dict(merged(cfg, overrides or {}))
        except KeyError as exc:
            raise ModelLoadError(f"{path} lacks the required field {exc.args[0]!r}.") from exc

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * element

    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        lm_head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * per_layer + h + lm_head


# Decoders of Qwen2's shape: a bias on q, k and v, the sliding window off unless `use_sliding_window` says so.
_QWEN2_TYPES = ("qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl", "qwen2_vl_text", "qwen2_5_vl_text")

# transformers' defaults for a decoder's config fields, by model type: published LLaVA configs give only what
# differs.
_DECODER_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096 * 32,
                    rms_norm_eps=1e-6, rope_theta=10000.0, sliding_window=4096),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  rope_theta=10000.0),
    "qwen2_vl_text": dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=32768,
                          rms_norm_eps=1e-5, rope_theta=1000000.0),
    "qwen2_5_vl_text": dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                            num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=32768,
                            rms_norm_eps=1e-5, rope_theta=1000000.0),
}


def _decoder_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A vision-language model's `text_config` as a decoder's config.json: its architecture the model's, and
    the dtype and token ids the model gives at its top level where the decoder's part does not."""
    text = dict(cfg["text_config"])
    text.setdefault("model_type", "llama")
    text = {**_DECODER_DEFAULTS.get(text["model_type"], {}), **text}
    text["architectures"] = cfg.get("architectures") or []
    for key in ("dtype", "torch_dtype", "eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if key in cfg and text.get(key) is None:
            text[key] = cfg[key]
    return text


def _parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5.x: rope_parameters holds theta and scaling; 4.x: rope_theta + rope_scaling.
    params = cfg.get("rope_parameters") or {}
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type layout
        params = params["full_attention"]
    scaling = cfg.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type == "mrope":  # transformers 4.x's name for Qwen2-VL's: default frequencies, turned by sections
        rope_type = "default"
    section = merged.get("mrope_section")
    if rope_type not in ("default", "linear", "llama3"):
        raise ModelLoadError(f"Unsupported rope_scaling type {rope_type!r}; supported: default, linear, llama3.")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=merged.get("original_max_position_embeddings"),
        mrope_section=tuple(int(n) for n in section) if section else None,
    )
