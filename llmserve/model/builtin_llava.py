"""A built-in random-weight LLaVA, written as a Hugging Face checkpoint in llava-hf's layout: the built-in Llama
of a size as its decoder, a CLIP vision tower (at `medium`, LLaVA-1.5's own: ViT-L/14 at 336 pixels), the
projector, a tokenizer with `<image>` added after the Llama's vocabulary, a chat template that places it, and
CLIP's image processor config. `transformers` loads it as `LlavaForConditionalGeneration`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from llmserve.model import builtin
from llmserve.multimodal.images import CLIP_MEAN, CLIP_STD

IMAGE_TOKEN = "<image>"
VOCAB_PADDING = 8  # the decoder's vocabulary past the tokenizer's: `<image>` and room (llava-1.5's 32064)
VISION_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=56,
                 patch_size=14),
    "small": dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, image_size=112,
                  patch_size=14),
    "medium": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                   image_size=336, patch_size=14),
}


def image_chat_template(image: str) -> str:
    """ChatML whose user turns may hold images, each written as `image` (a Jinja string literal's text) where it is
    in the message."""
    return (
        "{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
        f"{{% if part['type'] == 'image' %}}{{{{ '{image}' }}}}{{% elif part['type'] == 'text' %}}{{{{ part['text'] }}}}"
        "{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )


# Each image written as `<image>` and a newline where it is in the message.
CHAT_TEMPLATE = image_chat_template("<image>\\n")
_FEATURE_LAYER = -2


def build_config(size: str) -> dict[str, Any]:
    text = builtin.build_config("llama", size)
    text.update(vocab_size=text["vocab_size"] + VOCAB_PADDING, tie_word_embeddings=False)
    vision = VISION_SIZES[size]
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "image_seq_length": (vision["image_size"] // vision["patch_size"]) ** 2,
        "image_token_index": builtin.tokenizer_vocab_size(size),
        "model_type": "llava",
        "projector_hidden_act": "gelu",
        "text_config": text,
        "tie_word_embeddings": False,
        "torch_dtype": text["torch_dtype"],
        "transformers_version": builtin.TRANSFORMERS_VERSION,
        "vision_config": {**vision, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5, "model_type": "clip_vision_model",
                          "num_channels": 3, "projection_dim": 768},
        "vision_feature_layer": _FEATURE_LAYER,
        "vision_feature_select_strategy": "default",
    }


def vision_weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The vision tower's and the projector's weights, named as llava-hf's checkpoints name them."""
    vision, text_hidden = config["vision_config"], config["text_config"]["hidden_size"]
    hidden, inter, patch = vision["hidden_size"], vision["intermediate_size"], vision["patch_size"]
    tower = "vision_tower.vision_model"
    shapes: dict[str, tuple[int, ...]] = {
        f"{tower}.embeddings.class_embedding": (hidden,),
        f"{tower}.embeddings.patch_embedding.weight": (hidden, 3, patch, patch),
        f"{tower}.embeddings.position_embedding.weight": ((vision["image_size"] // patch) ** 2 + 1, hidden),
        f"{tower}.pre_layrnorm.weight": (hidden,), f"{tower}.pre_layrnorm.bias": (hidden,),
    }
    for layer in range(vision["num_hidden_layers"]):
        prefix = f"{tower}.encoder.layers.{layer}"
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes[f"{prefix}.self_attn.{name}.weight"] = (hidden, hidden)
            shapes[f"{prefix}.self_attn.{name}.bias"] = (hidden,)
        for norm in ("layer_norm1", "layer_norm2"):
            shapes[f"{prefix}.{norm}.weight"], shapes[f"{prefix}.{norm}.bias"] = (hidden,), (hidden,)
        shapes[f"{prefix}.mlp.fc1.weight"], shapes[f"{prefix}.mlp.fc1.bias"] = (inter, hidden), (inter,)
        shapes[f"{prefix}.mlp.fc2.weight"], shapes[f"{prefix}.mlp.fc2.bias"] = (hidden, inter), (hidden,)
    shapes[f"{tower}.post_layernorm.weight"], shapes[f"{tower}.post_layernorm.bias"] = (hidden,), (hidden,)
    shapes["multi_modal_projector.linear_1.weight"] = (text_hidden, hidden)
    shapes["multi_modal_projector.linear_1.bias"] = (text_hidden,)
    shapes["multi_modal_projector.linear_2.weight"] = (text_hidden, text_hidden)
    shapes["multi_modal_projector.linear_2.bias"] = (text_hidden,)
    return shapes


def _vision_weight(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Layer norms near 1 (their biases near 0), embeddings small, matrices of std 1/sqrt(fan-in): features of
    about unit size, which the projector brings to the token embeddings' size."""
    noise = torch.randn(shape, generator=generator)
    if "norm" in name:
        return (0.0 if name.endswith("bias") else 1.0) + builtin.NORM_NOISE_STD * noise
    if name.endswith("bias"):
        return 0.1 * noise
    if "embedding" in name:
        return noise * (0.5 if "position" in name or "class" in name else 1.0 / (shape[1] * shape[2] * shape[3]) ** 0.5)
    return noise / shape[1] ** 0.5


def make_llava(out_dir: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write the built-in LLaVA of `size` (tiny, small or medium) into `out_dir` and return it."""
    if size not in VISION_SIZES:
        raise ValueError(f"unknown built-in llava size {size!r}; choose one of {sorted(VISION_SIZES)}")
    config = build_config(size)
    out = Path(out_dir)
    write_vision_files(out, size, config, [IMAGE_TOKEN], CHAT_TEMPLATE,
                       _preprocessor_config(config["vision_config"]["image_size"]))
    _write_weights(out, config, seed)
    return out


def write_vision_files(out: Path, size: str, config: dict[str, Any], image_tokens: list[str], chat_template: str,
                       preprocessor: dict[str, Any]) -> None:
    """A built-in vision-language model's files but its weights: the built-in tokenizer of `size` with
    `image_tokens` added after its vocabulary, `chat_template`, config.json and `preprocessor` config."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = HFTokenizer.from_str(builtin.train_tokenizer(builtin.tokenizer_vocab_size(size)))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in image_tokens])
    assert tokenizer.token_to_id(image_tokens[0]) == builtin.tokenizer_vocab_size(size)
    tokenizer_json = tokenizer.to_str()
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    tokenizer_config = builtin.build_tokenizer_config(size, builtin.added_tokens(tokenizer_json))
    tokenizer_config["chat_template"] = chat_template
    builtin.write_json(out / "tokenizer_config.json", tokenizer_config)
    builtin.write_json(out / "special_tokens_map.json", builtin.build_special_tokens_map())
    builtin.write_json(out / "config.json", config)
    builtin.write_json(out / "generation_config.json", builtin.build_generation_config(size))
    builtin.write_json(out / "preprocessor_config.json", preprocessor)


def _write_weights(out: Path, config: dict[str, Any], seed: int) -> None:
    text = config["text_config"]
    dtype = builtin.DTYPES[text["torch_dtype"]]
    tensors: dict[str, torch.Tensor] = {}
    for _, shard in builtin.iter_shards(text, seed, shard_size=1 << 62):
        for name, tensor in shard.items():
            tensors["language_model." + name if name.startswith(("model.", "lm_head.")) else name] = tensor
    generator = torch.Generator().manual_seed(seed + 1)
    for name, shape in vision_weight_shapes(config).items():
        tensors[name] = _vision_weight(name, shape, generator).to(dtype).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _preprocessor_config(image_size: int) -> dict[str, Any]:
    """transformers' CLIPImageProcessor at `image_size`, as LLaVA-1.5's."""
    return {
        "crop_size": {"height": image_size, "width": image_size}, "do_center_crop": True, "do_convert_rgb": True,
        "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": list(CLIP_MEAN),
        "image_processor_type": "CLIPImageProcessor", "image_std": list(CLIP_STD),
        "resample": 3, "rescale_factor": 1 / 255, "size": {"shortest_edge": image_size},
    }
