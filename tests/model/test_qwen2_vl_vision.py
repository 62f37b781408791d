"""Qwen2-VL's and Qwen2.5-VL's images: prepared as transformers' (PIL) Qwen2VLImageProcessor prepares them, and
encoded by our vision towers as transformers' vision models encode them, on the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from llmserve.model.qwen2_vl_vision import Qwen2VisionTower, Qwen25VisionTower
from llmserve.multimodal.images import ImageProcessor, QwenImageProcessor, prepare, smart_resize

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig  # noqa: E402
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (  # noqa: E402
    Qwen2_5_VisionTransformerPretrainedModel,
)
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel  # noqa: E402

SMALL_MAX_PIXELS = 28 * 28 * 40

QWEN2_VISION = {"embed_dim": 64, "depth": 2, "num_heads": 4, "mlp_ratio": 4, "hidden_size": 48, "in_chans": 3,
                "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
QWEN25_VISION = {"hidden_size": 64, "out_hidden_size": 48, "intermediate_size": 96, "depth": 4, "num_heads": 4,
                 "hidden_act": "silu", "window_size": 56, "fullatt_block_indexes": [1, 3], "in_chans": 3,
                 "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}


def random_image(seed: int, width: int, height: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def patchify(pixels: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """transformers' `pixel_values` of one still image: [patches, channels * temporal * patch * patch], merge
    block by merge block, each patch repeated over the temporal axis."""
    channels, height, width = pixels.shape
    blocks = pixels.reshape(channels, height // (patch * merge), merge, patch, width // (patch * merge), merge, patch)
    patches = blocks.transpose(1, 4, 2, 5, 0, 3, 6).reshape(-1, channels, 1, patch, patch)
    return np.repeat(patches, temporal, axis=2).reshape(patches.shape[0], -1)


@pytest.mark.parametrize(("width", "height", "max_pixels"), [
    (100, 80, None), (333, 61, None), (640, 480, None), (61, 333, None),
    (20, 9, None),  # below min_pixels: grown
    (1500, 900, SMALL_MAX_PIXELS),  # above max_pixels: shrunk
])
def test_images_are_prepared_as_transformers_qwen2_vl_image_processor_prepares_them(width, height, max_pixels):
    budget = {} if max_pixels is None else {"max_pixels": max_pixels}
    theirs = Qwen2VLImageProcessorPil(**budget)
    ours = QwenImageProcessor.from_dict({"image_processor_type": "Qwen2VLImageProcessor", **budget})
    image = random_image(width, width, height)

    expected = theirs(images=[image], return_tensors="np")
    pixels = ours(image)

    assert pixels.dtype == np.float32 and pixels.shape[1:] == ours.resized_size((height, width))
    np.testing.assert_allclose(patchify(pixels, 14, 2, 2), expected["pixel_values"], rtol=0, atol=1e-6)
    grid_t, grid_h, grid_w = expected["image_grid_thw"][0].tolist()
    assert (grid_t, grid_h, grid_w) == (1, pixels.shape[1] // 14, pixels.shape[2] // 14)
    assert ours.grid((height, width)) == (grid_h // 2, grid_w // 2)
    assert ours.num_tokens((height, width)) == grid_t * grid_h * grid_w // 4
    assert ours.output_size() is None


def test_a_transparent_image_is_laid_over_white_as_transformers_does():
    rgba = np.random.default_rng(3).integers(0, 256, (70, 90, 4), dtype=np.uint8)
    image = Image.fromarray(rgba, mode="RGBA")
    expected = Qwen2VLImageProcessorPil()(images=[image], return_tensors="np")["pixel_values"]
    np.testing.assert_allclose(patchify(QwenImageProcessor()(image), 14, 2, 2), expected, rtol=0, atol=1e-6)


def test_smart_resize_keeps_sides_in_merge_blocks_within_the_pixel_budget():
    assert smart_resize(80, 100, 28, 56 * 56, 28 * 28 * 1280) == (84, 112)
    height, width = smart_resize(900, 1500, 28, 56 * 56, SMALL_MAX_PIXELS)
    assert height % 28 == width % 28 == 0 and height * width <= SMALL_MAX_PIXELS
    with pytest.raises(ValueError):
        smart_resize(10, 2100, 28, 56 * 56, 28 * 28 * 1280)


@pytest.mark.parametrize("cfg", [
    {"min_pixels": 1000, "max_pixels": 5000, "size": {"shortest_edge": 1, "longest_edge": 2}},
    {"size": {"shortest_edge": 1000, "longest_edge": 5000}},
])
def test_the_pixel_budget_is_read_from_either_config_layout(cfg):
    processor = QwenImageProcessor.from_dict(cfg)
    assert (processor.min_pixels, processor.max_pixels) == (1000, 5000)


def test_a_qwen2_vl_model_dir_gets_the_qwen_processor(tmp_path: Path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 12845056}))
    processor = ImageProcessor.from_dir(tmp_path)
    assert isinstance(processor, QwenImageProcessor) and processor.max_pixels == 12845056

    prepared = prepare(processor, random_image(5, 100, 80), "image", processor.num_tokens)
    assert prepared.pixels.shape == (3, 84, 112) and prepared.num_tokens == 3 * 4


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """The model with every parameter moved off its initial value (norms off one, biases off zero)."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


def encode_with_transformers(model: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    values = torch.from_numpy(patchify(pixels.numpy(), 14, 2, 2))
    grid_thw = torch.tensor([[1, pixels.shape[1] // 14, pixels.shape[2] // 14]])
    return model(values, grid_thw=grid_thw).pooler_output  # the merged tokens the decoder reads


@pytest.mark.parametrize(("build_theirs", "build_ours", "vision_config"), [
    (lambda cfg: Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(**cfg)), Qwen2VisionTower, QWEN2_VISION),
    (lambda cfg: Qwen2_5_VisionTransformerPretrainedModel(Qwen2_5_VLVisionConfig(**cfg)), Qwen25VisionTower,
     QWEN25_VISION),
], ids=["qwen2_vl", "qwen2_5_vl"])
def test_the_tower_encodes_images_as_transformers_vision_model_does(build_theirs, build_ours, vision_config):
    torch.manual_seed(0)
    theirs = perturbed(build_theirs(vision_config))
    ours = build_ours(vision_config, torch.float32).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    assert ours.out_dim == 48

    # (height, width): 3 x 5 merge blocks cut 2 x 2 windows short at both edges; 4 x 2 fill them exactly.
    for height, width in [(84, 140), (112, 56), (168, 84)]:
        pixels = torch.randn(3, height, width, generator=torch.Generator().manual_seed(height + width))
        with torch.no_grad():
            expected = encode_with_transformers(theirs, pixels)
            actual = ours(pixels)
        assert actual.shape == (height // 28 * (width // 28), 48)
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_the_tower_runs_in_bfloat16_from_float32_pixels():
    torch.manual_seed(0)
    tower = Qwen25VisionTower(QWEN25_VISION, torch.bfloat16).eval()
    with torch.no_grad():
        out = tower(torch.randn(3, 84, 140))
    assert out.dtype == torch.bfloat16 and out.shape == (15, 48) and torch.isfinite(out).all()
