"""CLIP's vision transformer (transformers' `CLIPVisionModel`), the image encoder of LLaVA models.

An image (normalised pixels, [3, size, size]) is cut into patches; each patch and a class token go through
pre-norm transformer layers with full (bidirectional) attention. A vision-language model reads the hidden
states of one layer (LLaVA: the second to last), so only the layers up to it are built; the rest of a
checkpoint's vision weights are not needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from llmserve.errors import ModelLoadError
from llmserve.model.layers import VisionLinear

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def activation(name: str):
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ModelLoadError(f"Activation {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}.") from None


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> VisionConfig:
        if cfg.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ModelLoadError(f"The vision tower {cfg.get('model_type')!r} is not supported; supported: "
                                 "clip_vision_model.")
        return cls(
            hidden_size=int(cfg.get("hidden_size", 768)),
            intermediate_size=int(cfg.get("intermediate_size", 3072)),
            num_hidden_layers=int(cfg.get("num_hidden_layers", 12)),
            num_attention_heads=int(cfg.get("num_attention_heads", 12)),
            image_size=int(cfg.get("image_size", 224)),
            patch_size=int(cfg.get("patch_size", 32)),
            layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-5)),
            hidden_act=cfg.get("hidden_act", "quick_gelu"),
        )

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class VisionEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.patch_embedding = nn.Conv2d(3, cfg.hidden_size, cfg.patch_size, cfg.patch_size, bias=False, dtype=dtype)
        self.position_embedding = nn.Embedding(cfg.num_patches + 1, cfg.hidden_size, dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [images, patches, hidden]
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        hidden = cfg.hidden_size
        self.q_proj = VisionLinear(hidden, hidden, dtype=dtype)
        self.k_proj = VisionLinear(hidden, hidden, dtype=dtype)
        self.v_proj = VisionLinear(hidden, hidden, dtype=dtype)
        self.out_proj = VisionLinear(hidden, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images, tokens, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(images, tokens, self.num_heads, -1).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).reshape(images, tokens, hidden))


class VisionLayer(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype)
        self.self_attn = VisionAttention(cfg, dtype)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype)
        self.mlp = nn.Module()
        self.mlp.fc1 = VisionLinear(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)
        self.mlp.fc2 = VisionLinear(cfg.intermediate_size, cfg.hidden_size, dtype=dtype)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class VisionTransformer(nn.Module):
    """transformers' `CLIPVisionTransformer` up to its layer `num_layers`, named as its checkpoint names them
    (without the `vision_model.` of published checkpoints); the model reads the hidden states it needs."""

    def __init__(self, cfg: VisionConfig, num_layers: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(cfg, dtype)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype=dtype)  # sic: CLIP's name
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(VisionLayer(cfg, dtype) for _ in range(num_layers))


def feature_layer_count(feature_layer: int, num_layers: int) -> int:
    """How many layers run to give `hidden_states[feature_layer]` (index 0: the embeddings; -1: the last layer)."""
    count = feature_layer if feature_layer >= 0 else num_layers + 1 + feature_layer
    if not 0 <= count <= num_layers:
        raise ModelLoadError(f"vision_feature_layer {feature_layer} is outside the tower's {num_layers} layers.")
    return count
