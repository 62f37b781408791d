"""The weights of a vision-language model's image side (its vision tower, and LLaVA's projector), loaded by name
beside the decoder's: each shape checked, and every one of them required."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from llmserve.errors import ModelLoadError


class VisionWeights:
    """Mixed in before a decoder class (`LlamaForCausalLM`): its `load_weights` reads the checkpoint's names as
    `rename_weights` makes them, and the tensors under `vision_modules`' prefixes go to those modules."""

    # The checkpoint's tower may hold layers past those read (LLaVA reads one layer's states): those are not needed.
    reads_part_of_tower = False

    def vision_modules(self) -> dict[str, nn.Module]:
        """{checkpoint prefix: module} of the image side."""
        raise NotImplementedError

    @staticmethod
    def rename_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint names as the decoder's loader and `vision_modules` read them."""
        raise NotImplementedError

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        modules = self.vision_modules()
        self._vision_params = {f"{prefix}.{name}": param for prefix, module in modules.items()
                               for name, param in module.named_parameters()}
        self._vision_prefixes = tuple(f"{prefix}." for prefix in modules)
        self._vision_loaded: set[str] = set()
        super().load_weights(self.rename_weights(weights))  # type: ignore[misc]

    def load_special(self, name: str, tensor: torch.Tensor) -> bool:
        if not name.startswith(self._vision_prefixes):
            return super().load_special(name, tensor)  # type: ignore[misc]
        param = self._vision_params.get(name)
        if param is None:
            if self.reads_part_of_tower:
                return True
            raise ModelLoadError(f"Checkpoint tensor {name!r} is not part of the vision tower.")
        if tuple(param.shape) != tuple(tensor.shape):
            raise ModelLoadError(f"Checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(param.shape)}.")
        param.data.copy_(tensor)
        self._vision_loaded.add(name)
        return True

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        vision = {name for name in params if name.startswith(self._vision_prefixes)}
        missing = sorted(vision - self._vision_loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ModelLoadError(f"The checkpoint lacks {len(missing)} vision weight(s): {shown}")
        super()._check_complete({k: v for k, v in params.items() if k not in vision}, loaded)  # type: ignore[misc]
