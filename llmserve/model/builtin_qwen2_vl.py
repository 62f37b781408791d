"""A built-in random-weight Qwen2-VL, written as a Hugging Face checkpoint in transformers' layout: the built-in
Llama of a size as its decoder (Qwen2's q, k and v biases, zero; M-RoPE sections scaled to its heads), a Qwen2-VL
vision tower (at `medium`, Qwen2-VL's own: 32 blocks 1280 wide), a tokenizer with Qwen2-VL's image tokens added
after the Llama's vocabulary, a chat template that places them, and Qwen2-VL's image processor config.
`transformers` loads it as `Qwen2VLForConditionalGeneration`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from llmserve.model import builtin
from llmserve.model.builtin_llava import VOCAB_PADDING, image_chat_template, write_vision_files
from llmserve.model.qwen2_vl_vision import Qwen2VisionTower
from llmserve.multimodal.images import CLIP_MEAN, CLIP_STD, QWEN_MAX_PIXELS, QWEN_MIN_PIXELS

IMAGE_TOKEN, VISION_START, VISION_END = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"
CHAT_TEMPLATE = image_chat_template(VISION_START + IMAGE_TOKEN + VISION_END)
VISION_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(embed_dim=32, depth=2, num_heads=4, mlp_ratio=2),
    "small": dict(embed_dim=128, depth=4, num_heads=4, mlp_ratio=4),
    "medium": dict(embed_dim=1280, depth=32, num_heads=16, mlp_ratio=4),
}


def mrope_section(head_dim: int) -> list[int]:
    """Qwen2-VL's (16, 24, 24) of a 128-wide head, scaled to `head_dim`."""
    quarter = head_dim // 8
    return [quarter, (head_dim // 2 - quarter) // 2, head_dim // 2 - quarter - (head_dim // 2 - quarter) // 2]


def build_config(size: str) -> dict[str, Any]:
    text = builtin.build_config("llama", size)
    first_token = builtin.tokenizer_vocab_size(size)
    text.update(model_type="qwen2_vl_text", vocab_size=text["vocab_size"] + VOCAB_PADDING, tie_word_embeddings=False,
                attention_bias=True, rope_scaling={"type": "mrope", "mrope_section": mrope_section(text["head_dim"])})
    text.pop("architectures")
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "image_token_id": first_token,
        "model_type": "qwen2_vl",
        "text_config": text,
        "tie_word_embeddings": False,
        "torch_dtype": text["torch_dtype"],
        "transformers_version": builtin.TRANSFORMERS_VERSION,
        "video_token_id": first_token + 3,
        "vision_config": {**VISION_SIZES[size], "hidden_size": text["hidden_size"], "hidden_act": "quick_gelu",
                          "in_channels": 3, "model_type": "qwen2_vl", "patch_size": 14, "spatial_merge_size": 2,
                          "temporal_patch_size": 2},
        "vision_end_token_id": first_token + 2,
        "vision_start_token_id": first_token + 1,
    }


def make_qwen2_vl(out_dir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write the built-in Qwen2-VL of `size` (tiny, small or medium) into `out_dir` and return it."""
    if size not in VISION_SIZES:
        raise ValueError(f"unknown built-in qwen2_vl size {size!r}; choose one of {sorted(VISION_SIZES)}")
    config = build_config(size)
    out = Path(out_dir)
    write_vision_files(out, size, config, [IMAGE_TOKEN, VISION_START, VISION_END], CHAT_TEMPLATE,
                       _preprocessor_config())
    _write_weights(out, config, seed)
    return out


def _write_weights(out: Path, config: dict[str, Any], seed: int) -> None:
    text = config["text_config"]
    dtype = builtin.DTYPES[text["torch_dtype"]]
    tensors: dict[str, torch.Tensor] = {}
    for _, shard in builtin.iter_shards(text, seed, shard_size=1 << 62):
        tensors.update(shard)
    for name in [n for n in tensors if n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]:
        tensors[name.removesuffix("weight") + "bias"] = torch.zeros(tensors[name].shape[0], dtype=dtype)
    torch.manual_seed(seed + 1)  # the tower's own initialisation: features of about unit size
    tower = Qwen2VisionTower(config["vision_config"], torch.float32)
    for name, tensor in tower.state_dict().items():
        tensors["visual." + name] = tensor.to(dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _preprocessor_config() -> dict[str, Any]:
    """transformers' Qwen2VLImageProcessor, as Qwen2-VL's."""
    return {
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": list(CLIP_MEAN), "image_processor_type": "Qwen2VLImageProcessor", "image_std": list(CLIP_STD),
        "max_pixels": QWEN_MAX_PIXELS, "merge_size": 2, "min_pixels": QWEN_MIN_PIXELS, "patch_size": 14,
        "resample": 3, "rescale_factor": 1 / 255, "temporal_patch_size": 2,
    }
