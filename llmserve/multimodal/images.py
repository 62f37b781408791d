"""Images as a vision-language model reads them: decoded from the bytes a request carries, then resized,
cropped and normalised as the checkpoint's `preprocessor_config.json` says (transformers' CLIP image processor;
with `image_grid_pinpoints`, LLaVA-NeXT's: the image whole and in tiles of the best of those resolutions; for
Qwen2-VL and Qwen2.5-VL, transformers' `Qwen2VLImageProcessor`: the image resized, its ratio kept, to a multiple of
the tower's merged patch within a pixel budget). Torch-free: it runs in the API process, on a worker thread.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from llmserve.errors import InvalidRequestError, ModelLoadError
from llmserve.multimodal.inputs import PreparedImage

MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 50_000_000  # past this PIL would decode a "decompression bomb": refused before decoding
# A thinner image, its short side resized to a tower's, would be billions of pixels long.
MAX_ASPECT_RATIO = 100
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageProcessor:
    """transformers' `CLIPImageProcessor`: the shortest edge resized to `shortest_edge` (or the image to
    `resize_to`), a centre crop, pixel values scaled to [0, 1] and normalised per channel."""

    shortest_edge: int | None
    resize_to: tuple[int, int] | None  # (height, width)
    resample: int
    crop: tuple[int, int] | None  # (height, width)
    rescale_factor: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    grid_pinpoints: tuple[tuple[int, int], ...] | None = None  # LLaVA-NeXT's tiled resolutions, (height, width)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ImageProcessor | QwenImageProcessor:
        """The processor `preprocessor_config.json` names: Qwen2-VL's (Qwen2.5-VL's too) for an
        `image_processor_type` of Qwen2VL..., else CLIP's (LLaVA-NeXT's with grid pinpoints)."""
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir} has no preprocessor_config.json: its images cannot be prepared.")
        cfg = json.loads(path.read_text())
        if str(cfg.get("image_processor_type", "")).startswith("Qwen2VL"):
            return QwenImageProcessor.from_dict(cfg)
        return cls.from_dict(cfg)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ImageProcessor:
        size = cfg.get("size") or {"shortest_edge": 224}
        if isinstance(size, int):
            size = {"shortest_edge": size}
        crop = cfg.get("crop_size") or {"height": 224, "width": 224}
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        resize = cfg.get("do_resize", True)
        return cls(
            shortest_edge=int(size["shortest_edge"]) if resize and "shortest_edge" in size else None,
            resize_to=(int(size["height"]), int(size["width"])) if resize and "height" in size else None,
            resample=int(cfg.get("resample", Image.Resampling.BICUBIC)),
            crop=(int(crop["height"]), int(crop["width"])) if cfg.get("do_center_crop", True) else None,
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) else None,
            mean=tuple(cfg.get("image_mean", CLIP_MEAN)) if cfg.get("do_normalize", True) else None,
            std=tuple(cfg.get("image_std", CLIP_STD)) if cfg.get("do_normalize", True) else None,
            grid_pinpoints=tuple(tuple(p) for p in cfg["image_grid_pinpoints"]) if cfg.get("image_grid_pinpoints")
            else None,
        )

    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every prepared image, when it does not depend on the image."""
        return self.crop or self.resize_to

    def __call__(self, image: Image.Image) -> np.ndarray:
        """[3, height, width] float32 pixel values; with grid pinpoints, [1 + tiles, 3, height, width]: the image
        resized whole, then its tiles."""
        image = image.convert("RGB")
        if self.grid_pinpoints is not None:
            return np.stack([self._prepare(view) for view in self._views(image)])
        return self._prepare(image)

    def _views(self, image: Image.Image) -> list[Image.Image]:
        """LLaVA-NeXT's: the image squashed to one tile, then the tiles of it resized (its ratio kept) into the best
        pinpoint resolution and padded there with black."""
        assert self.grid_pinpoints is not None and self.crop is not None
        tile = self.crop[0]
        height, width = best_resolution((image.height, image.width), self.grid_pinpoints)
        fitted_height, fitted_width = fitted_size((image.height, image.width), (height, width))
        canvas = Image.new("RGB", (width, height))
        canvas.paste(image.resize((fitted_width, fitted_height), self.resample),
                     ((width - fitted_width) // 2, (height - fitted_height) // 2))
        tiles = [canvas.crop((left, top, left + tile, top + tile))
                 for top in range(0, height, tile) for left in range(0, width, tile)]
        return [image.resize((tile, tile), self.resample), *tiles]

    def _prepare(self, image: Image.Image) -> np.ndarray:
        if self.shortest_edge is not None:
            image = image.resize(_shortest_edge_size(image.size, self.shortest_edge), self.resample)
        elif self.resize_to is not None:
            image = image.resize(self.resize_to[::-1], self.resample)
        pixels = np.asarray(image).transpose(2, 0, 1)  # channels first, as transformers crops
        if self.crop is not None:
            pixels = _center_crop(pixels, self.crop)
        values = pixels.astype(np.float32)
        if self.rescale_factor is not None:
            values = values * np.float32(self.rescale_factor)
        if self.mean is not None and self.std is not None:
            mean = np.asarray(self.mean, dtype=np.float32).reshape(3, 1, 1)
            std = np.asarray(self.std, dtype=np.float32).reshape(3, 1, 1)
            values = (values - mean) / std
        return np.ascontiguousarray(values, dtype=np.float32)


QWEN_MIN_PIXELS = 56 * 56
QWEN_MAX_PIXELS = 28 * 28 * 1280
QWEN_MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's (height, width) for an image: each side a multiple of `factor` as near its own as rounding
    gets, then, when the area falls outside [min_pixels, max_pixels], both sides scaled by one ratio into it
    (rounded down when shrinking, up when growing)."""
    if max(height, width) > QWEN_MAX_ASPECT_RATIO * min(height, width):
        raise ValueError(f"An image of {width}x{height} pixels is more than {QWEN_MAX_ASPECT_RATIO} times as long "
                         "as it is wide.")
    # Python's round (half to even) as transformers rounds, so a side at exactly half a factor lands the same.
    rounded_height, rounded_width = round(height / factor) * factor, round(width / factor) * factor
    if rounded_height * rounded_width > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        return (max(factor, math.floor(height / shrink / factor) * factor),
                max(factor, math.floor(width / shrink / factor) * factor))
    if rounded_height * rounded_width < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        return math.ceil(height * grow / factor) * factor, math.ceil(width * grow / factor) * factor
    return rounded_height, rounded_width


@dataclass(frozen=True)
class QwenImageProcessor:
    """transformers' `Qwen2VLImageProcessor` (Qwen2-VL's and Qwen2.5-VL's): the image resized to `smart_resize`'s
    size, pixel values scaled to [0, 1] and normalised per channel. Left whole: the tower cuts it into patches."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = QWEN_MIN_PIXELS
    max_pixels: int = QWEN_MAX_PIXELS
    resample: int = int(Image.Resampling.BICUBIC)
    rescale_factor: float | None = 1 / 255
    mean: tuple[float, ...] | None = CLIP_MEAN
    std: tuple[float, ...] | None = CLIP_STD

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> QwenImageProcessor:
        min_pixels, max_pixels = _qwen_pixel_budget(cfg)
        normalize = cfg.get("do_normalize", True)
        return cls(
            patch_size=int(cfg.get("patch_size", 14)),
            merge_size=int(cfg.get("merge_size", 2)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            resample=int(cfg.get("resample", Image.Resampling.BICUBIC)),
            rescale_factor=float(cfg.get("rescale_factor", 1 / 255)) if cfg.get("do_rescale", True) else None,
            mean=tuple(cfg.get("image_mean", CLIP_MEAN)) if normalize else None,
            std=tuple(cfg.get("image_std", CLIP_STD)) if normalize else None,
        )

    @property
    def factor(self) -> int:
        """The side of one merged patch (one decoder token), which both resized sides are multiples of."""
        return self.patch_size * self.merge_size

    def output_size(self) -> tuple[int, int] | None:
        """None: each image keeps (roughly) its own ratio and size."""
        return None

    def resized_size(self, size: tuple[int, int]) -> tuple[int, int]:
        """(height, width) an image of (height, width) `size` is resized to."""
        return smart_resize(size[0], size[1], self.factor, self.min_pixels, self.max_pixels)

    def grid(self, size: tuple[int, int]) -> tuple[int, int]:
        """(rows, columns) of the decoder tokens an image of `size` becomes."""
        height, width = self.resized_size(size)
        return height // self.factor, width // self.factor

    def num_tokens(self, size: tuple[int, int]) -> int:
        rows, columns = self.grid(size)
        return rows * columns

    def __call__(self, image: Image.Image) -> np.ndarray:
        """[3, height, width] float32 pixel values, height and width multiples of `factor`."""
        image = _rgb_on_white(image)
        height, width = self.resized_size((image.height, image.width))
        pixels = np.asarray(image.resize((width, height), self.resample)).transpose(2, 0, 1)
        if self.rescale_factor is not None:
            # Scaled in float64 and only then cast, as transformers rescales: the same float32 to the last bit.
            values = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        else:
            values = pixels.astype(np.float32)
        if self.mean is not None and self.std is not None:
            mean = np.asarray(self.mean, dtype=np.float32).reshape(3, 1, 1)
            std = np.asarray(self.std, dtype=np.float32).reshape(3, 1, 1)
            values = (values - mean) / std
        return np.ascontiguousarray(values, dtype=np.float32)


def _qwen_pixel_budget(cfg: dict[str, Any]) -> tuple[int, int]:
    """(min_pixels, max_pixels) of a Qwen2-VL preprocessor config: top-level keys (older configs; they win, as in
    transformers) or `size`'s shortest_edge / longest_edge (newer ones)."""
    size = cfg.get("size") if isinstance(cfg.get("size"), dict) else {}
    min_pixels = cfg.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels") or QWEN_MIN_PIXELS
    max_pixels = cfg.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels") or QWEN_MAX_PIXELS
    return int(min_pixels), int(max_pixels)


def _rgb_on_white(image: Image.Image) -> Image.Image:
    """The image in RGB, a transparent one laid over white (as transformers' Qwen2-VL processor converts it;
    `Image.convert("RGB")` alone would show whatever colour the transparent pixels hold)."""
    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    background = Image.new("RGBA", image.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")


def best_resolution(size: tuple[int, int], resolutions: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """LLaVA-NeXT's choice among (height, width) resolutions for an image of `size`: the one that keeps most of its
    pixels when it is scaled to fit, then the one that wastes least."""
    height, width = size
    best, best_kept, best_waste = resolutions[0], -1, math.inf
    for target_height, target_width in resolutions:
        scale = min(target_width / width, target_height / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        waste = target_width * target_height - kept
        if kept > best_kept or (kept == best_kept and waste < best_waste):
            best, best_kept, best_waste = (target_height, target_width), kept, waste
    return best


def fitted_size(size: tuple[int, int], target: tuple[int, int]) -> tuple[int, int]:
    """(height, width) of an image of `size` scaled, its ratio kept, to fit `target`."""
    height, width = size
    target_height, target_width = target
    scale_width, scale_height = target_width / width, target_height / height
    if scale_width < scale_height:
        return min(math.ceil(height * scale_width), target_height), target_width
    return target_height, min(math.ceil(width * scale_height), target_width)


def anyres_num_tokens(size: tuple[int, int], resolutions: tuple[tuple[int, int], ...], tile: int,
                      patches_per_side: int) -> int:
    """LLaVA-NeXT's tokens for an image of `size`: the whole image's patches, then the tiles' patch grid cut back to
    the image's own ratio, a newline token after each of its rows."""
    rows, columns = grid_shape(size, resolutions, tile)
    height, width = unpadded_size(size, (rows * patches_per_side, columns * patches_per_side))
    return patches_per_side**2 + height * (width + 1)


def grid_shape(size: tuple[int, int], resolutions: tuple[tuple[int, int], ...], tile: int) -> tuple[int, int]:
    """(rows, columns) of an image's tiles."""
    height, width = best_resolution(size, resolutions)
    return height // tile, width // tile


def unpadded_size(size: tuple[int, int], grid: tuple[int, int]) -> tuple[int, int]:
    """The part of a (height, width) feature grid an image of `size` covers (the padding around it cut off), as
    transformers' `unpad_image` cuts it."""
    height, width = size
    grid_height, grid_width = grid
    if width / height > grid_width / grid_height:
        new_height = int(round(height * (grid_width / width), 7))
        return grid_height - 2 * ((grid_height - new_height) // 2), grid_width
    new_width = int(round(width * (grid_height / height), 7))
    return grid_height, grid_width - 2 * ((grid_width - new_width) // 2)


def _shortest_edge_size(size: tuple[int, int], shortest: int) -> tuple[int, int]:
    """(width, height) with the shorter side `shortest` and the ratio kept (the longer side rounded down)."""
    width, height = size
    if width <= height:
        return shortest, int(shortest * height / width)
    return int(shortest * width / height), shortest


def _center_crop(pixels: np.ndarray, crop: tuple[int, int]) -> np.ndarray:
    """The centre `crop` of [channels, height, width] pixels, padded with zeros where the image is smaller."""
    crop_height, crop_width = crop
    _, height, width = pixels.shape
    if height < crop_height or width < crop_width:
        padded = np.zeros((pixels.shape[0], max(height, crop_height), max(width, crop_width)), dtype=pixels.dtype)
        top, left = (padded.shape[1] - height) // 2, (padded.shape[2] - width) // 2
        padded[:, top : top + height, left : left + width] = pixels
        pixels, height, width = padded, padded.shape[1], padded.shape[2]
    top, left = (height - crop_height) // 2, (width - crop_width) // 2
    return pixels[:, top : top + crop_height, left : left + crop_width]


def decode_image(data: bytes, param: str) -> Image.Image:
    """The image in `data` (PNG, JPEG, WebP, GIF, ...), fully decoded; a 400 naming `param` when it is none."""
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidRequestError(f"The image is {len(data)} bytes, more than the {MAX_IMAGE_BYTES} allowed.",
                                  param=param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise InvalidRequestError(f"The image is {image.width}x{image.height} pixels, more than the "
                                          f"{MAX_IMAGE_PIXELS} allowed.", param=param)
            image.load()
    except InvalidRequestError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError,
            Image.DecompressionBombWarning) as exc:
        raise InvalidRequestError(f"The image could not be decoded: {exc}", param=param) from None
    return image


def data_url_bytes(url: str, param: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL."""
    header, comma, payload = url.partition(",")
    if not comma or not header.startswith("data:") or not header.endswith(";base64"):
        raise InvalidRequestError("An image data URL must read data:<media type>;base64,<data>.", param=param)
    media_type = header.removeprefix("data:").removesuffix(";base64")
    if media_type and not media_type.startswith("image/"):
        raise InvalidRequestError(f"The data URL holds {media_type!r}, not an image.", param=param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError("The image data URL is not valid base64.", param=param) from None


def prepare(processor: ImageProcessor | QwenImageProcessor, image: bytes | Image.Image, param: str,
            num_tokens: Callable[[tuple[int, int]], int],
            span: Callable[[tuple[int, int]], int] | None = None) -> PreparedImage:
    """An image (its bytes, or decoded) prepared, with the tokens it takes (`num_tokens` of its size) and the
    positions it spans (`span` of its size; its tokens without it), named by its pixels and size: the same image,
    however encoded, has the same name (and the same KV to share)."""
    decoded = decode_image(image, param) if isinstance(image, bytes) else image
    size = (decoded.height, decoded.width)
    if max(size) > MAX_ASPECT_RATIO * min(size):
        raise InvalidRequestError(f"The image is {size[1]}x{size[0]} pixels: one side more than {MAX_ASPECT_RATIO} "
                                  "times the other is not read.", param=param)
    pixels = processor(decoded)
    digest = hashlib.blake2b(f"{pixels.shape}{size}".encode(), digest_size=16)
    digest.update(pixels.tobytes())
    tokens = num_tokens(size)
    return PreparedImage(pixels, digest.digest(), size, tokens, span(size) if span is not None else tokens)
