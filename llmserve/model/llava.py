"""LLaVA (transformers' `LlavaForConditionalGeneration`): a CLIP vision tower, a two-layer projector, and a
Llama-family decoder (Llama, Mistral, Qwen2) that reads the projected image features in place of the prompt's
image placeholder tokens.

The decoder is this class itself (it is a `LlamaForCausalLM`), so everything that serves a decoder (the paged
KV cache, the one-call CPU decoder for decode steps, quantization, tensor parallelism) serves it unchanged;
the runner computes `embed_images` for the placeholders a step covers and passes the step's input
embeddings in (`inputs_embeds`). The vision tower and projector are replicated on every tensor-parallel rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from llmserve.errors import ModelLoadError
from llmserve.model.clip import VisionConfig, VisionTransformer, activation, feature_layer_count
from llmserve.model.config import ModelConfig
from llmserve.model.llama import LlamaForCausalLM

TEXT_MODEL_TYPES = ("llama", "mistral", "qwen2")
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.")


class Projector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias, dtype=dtype)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias, dtype=dtype)
        self.act = activation(act)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        if cfg.model_type not in TEXT_MODEL_TYPES:
            raise ModelLoadError(f"LLaVA with a {cfg.model_type!r} decoder is not supported; supported decoders: "
                                 f"{', '.join(TEXT_MODEL_TYPES)}.")
        super().__init__(cfg, max_positions)
        raw = cfg.raw
        vision = VisionConfig.from_dict(raw.get("vision_config") or {})
        layers = raw.get("vision_feature_layer", -2)
        self.feature_layers = [layers] if isinstance(layers, int) else list(layers)
        self.keep_class_token = raw.get("vision_feature_select_strategy", "default") == "full"
        counts = [feature_layer_count(layer, vision.num_hidden_layers) for layer in self.feature_layers]
        self.feature_layers = counts  # as indexes of the hidden states, from 0 (the embeddings)
        self.vision_tower = VisionTransformer(vision, max(counts), cfg.dtype)
        self.vision_tower.requires_grad_(False)
        self.image_size = vision.image_size
        self.tokens_per_image = vision.num_patches + self.keep_class_token
        self.multi_modal_projector = Projector(
            vision.hidden_size * len(counts), cfg.hidden_size, raw.get("projector_hidden_act", "gelu"),
            bool(raw.get("multimodal_projector_bias", True)), cfg.dtype,
        ).requires_grad_(False)

    def embed_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """[images, tokens per image, hidden]: what stands in for each image's placeholder tokens."""
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

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._vision_params = dict(self.vision_tower.named_parameters(prefix="vision_tower"))
        self._vision_params.update(self.multi_modal_projector.named_parameters(prefix="multi_modal_projector"))
        self._vision_loaded: set[str] = set()
        super().load_weights(self.rename_weights(weights))

    def load_special(self, name: str, tensor: torch.Tensor) -> bool:
        if not name.startswith(_VISION_PREFIXES):
            return False
        params = self._vision_params
        if name not in params:
            return True  # the tower's layers after the one read, and its final norm: not needed
        if tuple(params[name].shape) != tuple(tensor.shape):
            raise ModelLoadError(f"Checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(params[name].shape)}.")
        params[name].data.copy_(tensor)
        self._vision_loaded.add(name)
        return True

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        vision = {name for name in params if name.startswith(_VISION_PREFIXES)}
        missing = sorted(vision - self._vision_loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ModelLoadError(f"The checkpoint lacks {len(missing)} vision weight(s): {shown}")
        super()._check_complete({k: v for k, v in params.items() if k not in vision}, loaded)
