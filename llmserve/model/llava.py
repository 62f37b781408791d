"""LLaVA (transformers' `LlavaForConditionalGeneration`) and LLaVA-NeXT (`LlavaNextForConditionalGeneration`): a
CLIP vision tower, a two-layer projector, and a Llama-family decoder (Llama, Mistral, Qwen2) that reads the
projected image features in place of the prompt's image placeholder tokens.

The decoder is this class itself (it is a `LlamaForCausalLM`), so everything that serves a decoder (the paged
KV cache, the one-call CPU decoder for decode steps, quantization, tensor parallelism) serves it unchanged;
the runner computes `embed_image` for the placeholders a step covers and passes the step's input
embeddings in (`inputs_embeds`). The vision tower and projector are replicated on every tensor-parallel rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch import nn

from llmserve.errors import ModelLoadError
from llmserve.model.clip import VisionConfig, VisionTransformer, activation, feature_layer_count
from llmserve.model.config import ModelConfig
from llmserve.model.layers import VisionLinear
from llmserve.model.llama import LlamaForCausalLM
from llmserve.model.vision_weights import VisionWeights
from llmserve.multimodal.images import anyres_num_tokens, grid_shape, unpadded_size

TEXT_MODEL_TYPES = ("llama", "mistral", "qwen2")


class Projector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_1 = VisionLinear(vision_hidden, text_hidden, bias=bias, dtype=dtype)
        self.linear_2 = VisionLinear(text_hidden, text_hidden, bias=bias, dtype=dtype)
        self.act = activation(act)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(VisionWeights, LlamaForCausalLM):
    reads_part_of_tower = True  # the layers after the one read, and the final norm

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        if cfg.model_type not in TEXT_MODEL_TYPES:
            raise ModelLoadError(f"LLaVA with a {cfg.model_type!r} decoder is not supported; supported decoders: "
                                 f"{', '.join(TEXT_MODEL_TYPES)}.")
        super().__init__(cfg, max_positions)
        raw = cfg.raw
        vision = VisionConfig.from_dict(raw.get("vision_config") or {})
        layers = raw.get("vision_feature_layer", -2)
        # The hidden states read, as indexes from 0 (the embeddings): each the layers that run to give it.
        counts = [feature_layer_count(layer, vision.num_hidden_layers)
                  for layer in ([layers] if isinstance(layers, int) else layers)]
        self.feature_layers = counts
        self.keep_class_token = raw.get("vision_feature_select_strategy", "default") == "full"
        self.vision_tower = VisionTransformer(vision, max(counts), cfg.dtype)
        self.vision_tower.requires_grad_(False)
        self.image_size = vision.image_size
        self.patches_per_side = vision.image_size // vision.patch_size
        self.multi_modal_projector = Projector(
            vision.hidden_size * len(counts), cfg.hidden_size, raw.get("projector_hidden_act", "gelu"),
            bool(raw.get("multimodal_projector_bias", True)), cfg.dtype,
        ).requires_grad_(False)

    def embed_image(self, pixels: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """[tokens, hidden]: what stands in for an image's placeholder tokens (`pixels` as prepared, [3, S, S]; `size`
        as it came, which LLaVA-NeXT's tiles depend on)."""
        return self.embed_views(pixels[None])[0]

    def image_tokens(self, size: tuple[int, int]) -> int:
        """The placeholder tokens an image of `size` takes."""
        return self.patches_per_side**2 + self.keep_class_token

    def largest_image(self, max_tokens: int) -> tuple[np.ndarray, tuple[int, int]]:
        """Pixels (zeros) and size of the image that takes the most tokens: what memory profiling reads (a LLaVA
        image's tokens are set by the model, not by `max_tokens`)."""
        return np.zeros((3, self.image_size, self.image_size), dtype=np.float32), (self.image_size, self.image_size)

    def embed_views(self, pixels: torch.Tensor) -> torch.Tensor:
        """[views, tokens per view, hidden]: the projected features of each [3, S, S] view."""
        x = self.vision_tower.pre_layrnorm(self.vision_tower.embeddings(pixels.to(self.config.dtype)))
        states = [x]
        for layer in self.vision_tower.encoder.layers:
            x = layer(x)
            states.append(x)
        features = torch.cat([states[i] for i in self.feature_layers], dim=-1)
        if not self.keep_class_token:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    # ---- weight loading -------------------------------------------------------------------------
    @staticmethod
    def rename_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint names as the decoder's loader reads them: the layouts of transformers before 4.52
        (`language_model.model.`) and after (`model.language_model.`) both become `model.`; the vision tower's
        (`vision_model.` within it in published checkpoints) keep their own."""
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith("language_model.lm_head."):
                name = name.removeprefix("language_model.")
            elif name.startswith("language_model."):
                name = "model." + name.removeprefix("language_model.").removeprefix("model.")
            elif name.startswith("vision_tower.vision_model."):
                name = "vision_tower." + name.removeprefix("vision_tower.vision_model.")
            yield name, tensor

    def vision_modules(self) -> dict[str, nn.Module]:
        return {"vision_tower": self.vision_tower, "multi_modal_projector": self.multi_modal_projector}


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-NeXT (1.6): an image is read whole (one view, squashed) and in tiles of the best of the model's
    `image_grid_pinpoints` resolutions; the tiles' features, as a grid cut back to the image's own ratio with a
    learned `image_newline` after each row, follow the whole image's (transformers' `pack_image_features`)."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(cfg, max_positions)
        if self.keep_class_token:
            raise ModelLoadError("LLaVA-NeXT's tiles are read with vision_feature_select_strategy 'default' only.")
        self.grid_pinpoints = tuple(tuple(p) for p in cfg.raw["image_grid_pinpoints"])
        self.image_newline = nn.Parameter(torch.empty(cfg.hidden_size, dtype=cfg.dtype), requires_grad=False)

    def embed_image(self, pixels: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        views = self.embed_views(pixels)  # [1 + tiles, patches, hidden]
        side, hidden = self.patches_per_side, views.shape[-1]
        rows, columns = grid_shape(size, self.grid_pinpoints, self.image_size)
        grid = views[1:].view(rows, columns, side, side, hidden).permute(0, 2, 1, 3, 4)
        grid = grid.reshape(rows * side, columns * side, hidden)
        height, width = unpadded_size(size, (rows * side, columns * side))
        top, left = (rows * side - height) // 2, (columns * side - width) // 2
        grid = grid[top : top + height, left : left + width]
        newlines = self.image_newline.to(grid.dtype).expand(height, 1, hidden)
        return torch.cat([views[0], torch.cat([grid, newlines], dim=1).reshape(-1, hidden)])

    def image_tokens(self, size: tuple[int, int]) -> int:
        return anyres_num_tokens(size, self.grid_pinpoints, self.image_size, self.patches_per_side)

    def largest_image(self, max_tokens: int) -> tuple[np.ndarray, tuple[int, int]]:
        size = max(self.grid_pinpoints, key=lambda p: p[0] * p[1])
        views = 1 + (size[0] // self.image_size) * (size[1] // self.image_size)
        return np.zeros((views, 3, self.image_size, self.image_size), dtype=np.float32), size

    def load_special(self, name: str, tensor: torch.Tensor) -> bool:
        if name in ("image_newline", "model.image_newline"):
            self.image_newline.data.copy_(tensor)
            self._vision_loaded.add("image_newline")
            return True
        return super().load_special(name, tensor)

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        if "image_newline" not in self._vision_loaded:
            raise ModelLoadError("The checkpoint lacks LLaVA-NeXT's image_newline.")
        super()._check_complete({k: v for k, v in params.items() if k != "image_newline"}, loaded)
