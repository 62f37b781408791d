"""A prompt's images on their way to the engine: where their placeholder tokens are, and their pixels."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from llmserve.errors import InvalidRequestError


class ImageInput(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """An image of a prompt: the `length` placeholder tokens from `offset` that its features replace, its prepared
    pixels (float32, C-ordered `shape`: one view of it, or several: LLaVA-NeXT's tiles) and its size as it came
    (height, width), named by `digest` (the prefix cache tells images apart by it). `span` is how many positions it
    moves its sequence on: its tokens, or under Qwen2-VL's M-RoPE the longer side of its token grid."""

    offset: int
    length: int
    digest: bytes
    pixels: bytes
    shape: tuple[int, ...]
    size: tuple[int, int]
    span: int

    @property
    def shift(self) -> int:
        """How far the positions of the tokens after it lag their indexes, for this image."""
        return self.span - self.length

    def pixel_array(self) -> np.ndarray:
        return np.frombuffer(self.pixels, dtype=np.float32).reshape(self.shape)


@dataclass(frozen=True)
class PreparedImage:
    pixels: np.ndarray  # float32: [3, height, width], or [views, 3, height, width]
    digest: bytes
    size: tuple[int, int]  # (height, width) as it came
    num_tokens: int  # the placeholder tokens it takes in the prompt
    span: int  # the positions it moves its sequence on (`ImageInput.span`)


class ImagePrompt(list[int]):
    """Prompt token ids with the images their placeholder runs stand for: a prompt wherever token ids go."""

    def __init__(self, token_ids: Sequence[int], images: Sequence[ImageInput]) -> None:
        super().__init__(token_ids)
        self.images = list(images)


def expand_placeholders(token_ids: Sequence[int], placeholder: int, counts: Sequence[int]) -> list[int]:
    """Each placeholder token (one per image, as a chat template writes it) as the tokens its image takes: the
    i-th as `counts[i]`. A placeholder past the counts stays one token (an image nobody sent: refused later)."""
    out: list[int] = []
    images = iter(counts)
    for token in token_ids:
        if token == placeholder:
            out.extend([placeholder] * next(images, 1))
        else:
            out.append(token)
    return out


def placed_images(token_ids: Sequence[int], images: Sequence[PreparedImage], placeholder: int) -> list[PreparedImage]:
    """The images whose tokens expanded token ids hold: the last of `images` (fitting a conversation to the context
    drops its earliest turns); a 400 when no run of the last images fills the placeholders exactly."""
    remaining = int(np.count_nonzero(np.asarray(token_ids, dtype=np.int64) == placeholder))
    kept = len(images)
    while remaining > 0 and kept > 0:
        kept -= 1
        remaining -= images[kept].num_tokens
    if remaining:
        raise _placeholders_mismatch(len(images))
    return list(images[kept:])


def image_prompt(token_ids: Sequence[int], images: Sequence[PreparedImage], placeholder: int) -> ImagePrompt:
    """Expanded token ids with `images` placed at their placeholder runs, in order. Text that spells the
    placeholder is a 400: it would stand for an image nobody sent."""
    positions = np.flatnonzero(np.asarray(token_ids, dtype=np.int64) == placeholder)
    if len(positions) != sum(image.num_tokens for image in images):
        raise _placeholders_mismatch(len(images))
    inputs, start = [], 0
    for image in images:
        run = positions[start : start + image.num_tokens]
        if run[-1] - run[0] != image.num_tokens - 1:
            raise InvalidRequestError("The prompt's image placeholder tokens are not in whole runs, one per image.",
                                      param="messages")
        inputs.append(ImageInput(int(run[0]), image.num_tokens, image.digest, image.pixels.tobytes(),
                                 image.pixels.shape, image.size, image.span))
        start += image.num_tokens
    return ImagePrompt(token_ids, inputs)


def _placeholders_mismatch(num_images: int) -> InvalidRequestError:
    return InvalidRequestError(f"The prompt's image placeholders do not match the {num_images} images sent (text may "
                               "not spell the model's image placeholder).", param="messages")
