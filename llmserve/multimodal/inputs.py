"""A prompt's images on their way to the engine: where their placeholder tokens are, and their pixels."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from llmserve.errors import InvalidRequestError


class ImageInput(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """An image of a prompt: the `length` placeholder tokens from `offset` that its features replace, and its
    prepared pixels (float32, C-ordered `shape`), named by `digest` (the prefix cache tells images apart by it)."""

    offset: int
    length: int
    digest: bytes
    pixels: bytes
    shape: tuple[int, int, int]

    def pixel_array(self) -> np.ndarray:
        return np.frombuffer(self.pixels, dtype=np.float32).reshape(self.shape)


@dataclass(frozen=True)
class PreparedImage:
    pixels: np.ndarray  # [3, height, width] float32
    digest: bytes


class ImagePrompt(list[int]):
    """Prompt token ids with the images their placeholder runs stand for: a prompt wherever token ids go."""

    def __init__(self, token_ids: Sequence[int], images: Sequence[ImageInput]) -> None:
        super().__init__(token_ids)
        self.images = list(images)


def expand_placeholders(token_ids: Sequence[int], placeholder: int, tokens_per_image: int) -> list[int]:
    """Each placeholder token (one per image, as a chat template writes it) as the image's `tokens_per_image`."""
    out: list[int] = []
    for token in token_ids:
        if token == placeholder:
            out.extend([placeholder] * tokens_per_image)
        else:
            out.append(token)
    return out


def image_offsets(token_ids: Sequence[int], placeholder: int, tokens_per_image: int) -> list[int]:
    """Where each image's run of placeholders starts in expanded token ids (runs of a multiple of the length are
    adjacent images); a 400 when a run is not whole."""
    ids = np.asarray(token_ids, dtype=np.int64)
    positions = np.flatnonzero(ids == placeholder)
    if len(positions) % tokens_per_image:
        raise InvalidRequestError(f"The prompt has {len(positions)} image placeholder tokens, not a multiple of the "
                                  f"{tokens_per_image} each image takes.", param="messages")
    starts = positions[::tokens_per_image]
    if np.any(positions.reshape(-1, tokens_per_image)[:, -1] - starts != tokens_per_image - 1):
        raise InvalidRequestError("The prompt's image placeholder tokens are not in whole runs, one per image.",
                                  param="messages")
    return starts.tolist()


def image_prompt(token_ids: Sequence[int], images: Sequence[PreparedImage], placeholder: int,
                 tokens_per_image: int) -> ImagePrompt:
    """Expanded token ids with `images` placed at their placeholder runs, in order. Text that spells the
    placeholder is a 400: it would stand for an image nobody sent."""
    offsets = image_offsets(token_ids, placeholder, tokens_per_image)
    if len(offsets) != len(images):
        raise InvalidRequestError(f"The prompt has places for {len(offsets)} images but {len(images)} were sent (text "
                                  "may not spell the model's image placeholder).", param="messages")
    return ImagePrompt(token_ids, [
        ImageInput(offset, tokens_per_image, image.digest, image.pixels.tobytes(), image.pixels.shape)
        for offset, image in zip(offsets, images, strict=True)
    ])
