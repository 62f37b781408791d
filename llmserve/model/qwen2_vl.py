"""Qwen2-VL and Qwen2.5-VL (transformers' `Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`):
a vision tower that reads an image at (about) its own resolution (`qwen2_vl_vision.py`), and a Qwen2 decoder whose
rotary embedding turns with three position ids per token (M-RoPE).

An image takes one placeholder token per 28x28 pixels (2x2 merged patches) and moves its sequence on by the longer
side of that token grid, not by its tokens: its tokens' (temporal, height, width) ids count along the grid from where
the image starts. The engine tells the runner how far each token's position lags its index (`ImageInput.span`); the
runner writes image tokens' rotary rows (`MRotaryEmbedding.place`) from `image_grid`.

The decoder is this class itself (a `LlamaForCausalLM`), so everything that serves a decoder serves it; a decode
step's tokens have one position id each (the three are equal), so the one-call CPU decoder and CUDA graphs read
them as any decoder's. The vision tower is replicated on every tensor-parallel rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch import nn

from llmserve.model.config import ModelConfig
from llmserve.model.llama import LlamaForCausalLM
from llmserve.model.qwen2_vl_vision import Qwen2VisionTower, Qwen25VisionTower
from llmserve.model.vision_weights import VisionWeights

DEFAULT_MROPE_SECTION = (16, 24, 24)  # transformers' default: Qwen2-VL-7B's and 72B's, and Qwen2.5-VL's


class Qwen2VLForConditionalGeneration(VisionWeights, LlamaForCausalLM):
    tower_class: type[nn.Module] = Qwen2VisionTower

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        section = cfg.rope.mrope_section or DEFAULT_MROPE_SECTION
        cfg = dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, mrope_section=section))
        super().__init__(cfg, max_positions)
        vision = dict(cfg.raw.get("vision_config") or {})
        self.visual = self.tower_class(vision, cfg.dtype).requires_grad_(False)
        self.patch_size = int(vision.get("patch_size", 14))
        self.merge_size = int(vision.get("spatial_merge_size", 2))

    @property
    def token_pixels(self) -> int:
        """The side of the pixel square one placeholder token stands for."""
        return self.patch_size * self.merge_size

    def embed_image(self, pixels: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """[tokens, hidden]: what stands in for an image's placeholder tokens (`pixels` as prepared, [3, H, W] at
        the resolution the processor chose; `size`, as it came, changes nothing more)."""
        return self.visual(pixels)

    def image_grid(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """(frames, rows, columns) of the token grid of prepared pixels of `shape`: the order its tokens come in."""
        return 1, shape[-2] // self.token_pixels, shape[-1] // self.token_pixels

    def image_tokens(self, size: tuple[int, int]) -> int:
        """The placeholder tokens of an image prepared at `size` (height, width; multiples of `token_pixels`)."""
        return (size[0] // self.token_pixels) * (size[1] // self.token_pixels)

    def largest_image(self, max_tokens: int) -> tuple[np.ndarray, tuple[int, int]]:
        """Pixels (zeros) and size of the largest square image within `max_tokens`: what memory profiling reads (the
        server resizes no image past a step's tokens)."""
        side = max(1, math.isqrt(max_tokens)) * self.token_pixels
        return np.zeros((3, side, side), dtype=np.float32), (side, side)

    # ---- weight loading -------------------------------------------------------------------------
    @staticmethod
    def rename_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint names as the decoder's loader reads them: transformers' layout since 4.52
        (`model.language_model.`, `model.visual.`) and the one published checkpoints have (`model.`, `visual.`)."""
        for name, tensor in weights:
            if name.startswith("model.language_model."):
                name = "model." + name.removeprefix("model.language_model.")
            elif name.startswith("model.visual."):
                name = name.removeprefix("model.")
            yield name, tensor

    def vision_modules(self) -> dict[str, nn.Module]:
        return {"visual": self.visual}


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):  # noqa: N801 (transformers' name)
    """Qwen2.5-VL: the same decoder; a tower with windowed attention in most blocks, RMSNorm and a gated MLP."""

    tower_class = Qwen25VisionTower
