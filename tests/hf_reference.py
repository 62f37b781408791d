"""Reference checkpoints written by `transformers` (a test-time dependency only) and its greedy decode."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from llmserve.model import builtin_llava, builtin_qwen2_vl

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

_COMMON = dict(
    vocab_size=1024, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
)

# name -> (config class name, overrides). Together they cover every architecture and config feature the
# loader claims: llama3 / linear rope scaling, tied and untied embeddings, GQA and MQA, qkv bias,
# q/k norms with an explicit head_dim, Mistral's sliding window field, mixtures of experts, and a sharded checkpoint.
ARCH_CASES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "llama-llama3-tied": ("LlamaConfig", dict(
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64}, rope_theta=500000.0)),
    "llama-linear-mqa": ("LlamaConfig", dict(num_key_value_heads=1, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),
    "mistral": ("MistralConfig", dict(sliding_window=4096, num_key_value_heads=1)),
    # mixtures of experts: 4 experts, 2 a token; Qwen3-MoE's second layer dense (`mlp_only_layers`), Qwen2-MoE's
    # first (`decoder_sparse_step`) and a shared expert
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                         norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen2-moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                         shared_expert_intermediate_size=96, decoder_sparse_step=2)),
}


def build_checkpoint(
    case: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0, shard: bool = False,
    labels: tuple[str, ...] | None = None,
) -> Path:
    """`labels`: the decoder as a sequence classifier (`*ForSequenceClassification`: a `score` head on the last
    token, as reward models and Qwen3-Reranker's seq-cls form), its pad id one that text never encodes to."""
    import transformers

    cls_name, overrides = ARCH_CASES[case]
    if labels is not None:
        overrides = {**overrides, "num_labels": len(labels), "id2label": dict(enumerate(labels)),
                     "label2id": {label: i for i, label in enumerate(labels)}, "pad_token_id": 1}
    config = getattr(transformers, cls_name)(**{**_COMMON, **overrides})
    torch.manual_seed(seed)
    auto = transformers.AutoModelForCausalLM if labels is None else transformers.AutoModelForSequenceClassification
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init: clear logit margins, no near-ties
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08 if "embed" not in name else 1.0)
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(out_dir, max_shard_size="200KB" if shard else "2GB")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def load_model(model_dir: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decode with the reference implementation's own KV cache, never stopping at eos."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return generated


CROSS_ENCODER_SIZES = {  # "minilm": ms-marco-MiniLM-L-6-v2's shape; "base": bge-reranker-base's (BERT-base's)
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128),
    "minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
}


def build_cross_encoder(
    kind: str, out_dir: Path, wordpiece_dir: Path, labels: tuple[str, ...] | None = ("LABEL_0",), size: str = "tiny",
    seed: int = 0, problem_type: str | None = None,
) -> Path:
    """A random sequence classifier in transformers' layout, on a BERT WordPiece vocabulary (`wordpiece_dir`,
    e.g. all-MiniLM-L6-v2's): `kind` "bert" is ms-marco-MiniLM's layout (BertForSequenceClassification, token
    type 1 for a pair's second text), "xlm-roberta" bge-reranker's (positions after the padding id, one token
    type, the pair joined as `[CLS] a [SEP][SEP] b [SEP]`). One label: a cross-encoder reranker. `labels` None:
    the encoder alone (BertModel, XLMRobertaModel: bge-m3's layout). `problem_type` "multi_label_classification":
    labels that are not exclusive (a toxicity classifier's)."""
    import tokenizers
    import transformers

    common: dict = dict(vocab_size=30522, **CROSS_ENCODER_SIZES[size])
    if labels is not None:
        common.update(num_labels=len(labels), id2label=dict(enumerate(labels)),
                      label2id={label: i for i, label in enumerate(labels)}, problem_type=problem_type)
    torch.manual_seed(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    if kind == "bert":
        config = transformers.BertConfig(max_position_embeddings=128, **common)
        model = (transformers.BertModel if labels is None else transformers.BertForSequenceClassification)(config)
        for name in (*TOKENIZER_FILES, "vocab.txt"):
            shutil.copy(wordpiece_dir / name, out_dir / name)
    else:  # 130 positions after pad id 1: 128 tokens, as XLM-R's 514 give 512
        config = transformers.XLMRobertaConfig(max_position_embeddings=130, pad_token_id=1, type_vocab_size=1, **common)
        model = (transformers.XLMRobertaModel if labels is None else transformers.XLMRobertaForSequenceClassification)(
            config)
        tokenizer = tokenizers.Tokenizer.from_file(str(wordpiece_dir / "tokenizer.json"))
        tokenizer.post_processor = tokenizers.processors.RobertaProcessing(("[SEP]", 102), ("[CLS]", 101))
        tokenizer.save(str(out_dir / "tokenizer.json"))
        (out_dir / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "model_input_names": ["input_ids", "attention_mask"],
            "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
            "model_max_length": 128,
        }))
    with torch.no_grad():  # larger than the default init, so that pairs' scores differ clearly
        for name, p in model.named_parameters():
            if "LayerNorm" not in name:
                p.normal_(0.0, 0.1)
    model.eval().save_pretrained(out_dir)
    return out_dir


ALL_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_lora_adapter(
    base_dir: Path, out_dir: Path, targets: tuple[str, ...] = ALL_LORA_TARGETS, rank: int = 8, alpha: int = 16,
    seed: int = 0, rslora: bool = False, **config,
) -> Path:
    """A PEFT LoRA adapter of random A and B (not PEFT's zero B: it must change the output) over `base_dir`,
    written as PEFT writes one (adapter_config.json, adapter_model.safetensors)."""
    import peft

    base = load_model(base_dir)
    lora = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                           use_rslora=rslora, **config)
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.15)
    model.save_pretrained(out_dir)
    return out_dir


def load_with_adapter(base_dir: Path, adapter_dir: Path):
    import peft

    return peft.PeftModel.from_pretrained(load_model(base_dir), adapter_dir).eval()


# The built-in LLaVA's placeholder and its ChatML template that places one `<image>` per image part (the server
# expands each to the image's tokens), as llava-hf's templates place theirs.
IMAGE_TOKEN, LLAVA_CHAT_TEMPLATE = builtin_llava.IMAGE_TOKEN, builtin_llava.CHAT_TEMPLATE


def build_llava(
    out_dir: Path, tokenizer_dir: Path, seed: int = 0, image_size: int = 56, patch_size: int = 14,
    feature_layer: int | list[int] = -2, strategy: str = "default", text_case: str = "llama",
) -> Path:
    """A random LLaVA-1.5-shaped checkpoint in transformers' layout: a CLIP vision tower of (image_size /
    patch_size)² patches, the projector, and the `text_case` decoder; the tokenizer of `tokenizer_dir` with
    `<image>` added as token 1024 and a chat template that places it; CLIP's image processor config."""
    import tokenizers
    import transformers

    cls_name, overrides = ARCH_CASES[text_case]
    text = getattr(transformers, cls_name)(**{**_COMMON, **overrides, "vocab_size": 1032})
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, image_size=image_size, patch_size=patch_size)
    num_tokens = (image_size // patch_size) ** 2 + (strategy == "full")
    config = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_id=1024,
                                      vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy,
                                      image_seq_length=num_tokens)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():  # larger weights than the default init: clear logit margins, images that matter
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.08 if "embed_tokens" not in name else 1.0)
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(out_dir)
    tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([tokenizers.AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    assert tokenizer.token_to_id(IMAGE_TOKEN) == 1024
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = LLAVA_CHAT_TEMPLATE
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    shutil.copy(tokenizer_dir / "special_tokens_map.json", out_dir / "special_tokens_map.json")
    transformers.CLIPImageProcessor(size={"shortest_edge": image_size},
                                    crop_size={"height": image_size, "width": image_size}).save_pretrained(out_dir)
    return out_dir


def load_llava(model_dir: Path):
    import transformers

    return transformers.LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def greedy_with_images(model, prompt_ids: list[int], pixel_values: torch.Tensor, max_new_tokens: int,
                       **inputs: torch.Tensor) -> list[int]:
    """Greedy decode of a prompt (its image placeholders already expanded) with the images' pixels (and the other
    `inputs` the model reads them with: Qwen2-VL's grids and image token types)."""
    out = model(input_ids=torch.tensor([prompt_ids]), pixel_values=pixel_values, use_cache=True, **inputs)
    generated: list[int] = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        generated.append(token)
        out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return generated


LLAVA_NEXT_PINPOINTS = [[56, 112], [112, 56], [112, 112], [168, 56], [56, 168]]  # llava-v1.6's shapes, at a 56 tile


def build_llava_next(out_dir: Path, tokenizer_dir: Path, seed: int = 0, text_case: str = "mistral") -> Path:
    """A random LLaVA-NeXT (1.6) checkpoint in transformers' layout: LLaVA's tower, projector and tokenizer (see
    `build_llava`), tiles of 56 pixels in the grid of llava-v1.6's shapes, the `image_newline`, the `text_case`
    decoder (llava-v1.6-mistral's by default), and LLaVA-NeXT's image processor config."""
    import transformers

    build_llava(out_dir, tokenizer_dir, seed, text_case=text_case)  # then made NeXT: config, newline, processor
    llava = transformers.LlavaConfig.from_pretrained(out_dir)
    config = transformers.LlavaNextConfig(text_config=llava.text_config, vision_config=llava.vision_config,
                                          image_token_id=1024, image_grid_pinpoints=LLAVA_NEXT_PINPOINTS,
                                          vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(seed + 1)
    model = transformers.LlavaNextForConditionalGeneration(config).to(torch.float32)
    reference = transformers.LlavaForConditionalGeneration.from_pretrained(out_dir, dtype=torch.float32)
    weights = dict(reference.state_dict())
    with torch.no_grad():
        missing, _ = model.load_state_dict(weights, strict=False)
        assert all("image_newline" in name for name in missing), missing
        model.model.image_newline.normal_(0.0, 1.0)
    (out_dir / "model.safetensors").unlink()
    model.save_pretrained(out_dir)
    transformers.LlavaNextImageProcessorPil(
        size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56},
        image_grid_pinpoints=LLAVA_NEXT_PINPOINTS).save_pretrained(out_dir)
    return out_dir


def load_llava_next(model_dir: Path):
    import transformers

    return transformers.LlavaNextForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()


# Qwen2-VL's image tokens, added after the tiny tokenizer's vocabulary, and the built-in Qwen2-VL's ChatML template
# that writes each image part as Qwen2-VL's templates do.
QWEN_VL_TOKENS = (builtin_qwen2_vl.IMAGE_TOKEN, builtin_qwen2_vl.VISION_START, builtin_qwen2_vl.VISION_END)
QWEN_VL_CHAT_TEMPLATE = builtin_qwen2_vl.CHAT_TEMPLATE
QWEN_VL_MAX_PIXELS = 28 * 28 * 48  # images of at most 48 tokens: quick towers


def build_qwen2_vl(out_dir: Path, tokenizer_dir: Path, seed: int = 0, version: str = "2") -> Path:
    """A random Qwen2-VL (`version` "2") or Qwen2.5-VL ("2.5") checkpoint in transformers' layout: a small vision
    tower, a Qwen2 decoder with M-RoPE sections for its 16-wide heads, the tokenizer of `tokenizer_dir` with Qwen2-VL's
    image tokens added (1024-1026), a chat template that places them, and Qwen2-VL's image processor config (images
    of at most `QWEN_VL_MAX_PIXELS`)."""
    import tokenizers
    import transformers

    text = {**_COMMON, "vocab_size": 1032, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                                 "mrope_section": [2, 3, 3]}}
    if version == "2":
        vision = dict(depth=2, embed_dim=32, num_heads=4, hidden_size=64, mlp_ratio=2)
        config_class, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    else:
        vision = dict(depth=3, hidden_size=32, num_heads=4, intermediate_size=48, out_hidden_size=64,
                      window_size=56, fullatt_block_indexes=[1])
        config_class, model_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    config = config_class(text_config=text, vision_config=vision, image_token_id=1024, vision_start_token_id=1025,
                          vision_end_token_id=1026, video_token_id=1027, bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    with torch.no_grad():  # larger weights than the default init: clear logit margins, images that matter
        for name, p in model.named_parameters():
            if "norm" not in name and "ln_q" not in name:
                p.normal_(0.0, 0.08 if "embed_tokens" not in name else 1.0)
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(out_dir)
    tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in QWEN_VL_TOKENS])
    assert tokenizer.token_to_id(QWEN_VL_TOKENS[0]) == 1024
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = QWEN_VL_CHAT_TEMPLATE
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    shutil.copy(tokenizer_dir / "special_tokens_map.json", out_dir / "special_tokens_map.json")
    transformers.Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=QWEN_VL_MAX_PIXELS).save_pretrained(out_dir)
    return out_dir


def load_qwen2_vl(model_dir: Path):
    import transformers

    return transformers.AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


def qwen2_vl_inputs(model_dir: Path, prompt_ids: list[int], images: list, image_token: int = 1024
                    ) -> dict[str, torch.Tensor]:
    """transformers' inputs for a Qwen2-VL prompt whose `<|image_pad|>` runs are already expanded: the images'
    patches and grids from its own image processor, and which tokens are image tokens."""
    import transformers

    processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    prepared = processor(images=images, return_tensors="pt")
    ids = torch.tensor([prompt_ids])
    return dict(pixel_values=prepared["pixel_values"], image_grid_thw=prepared["image_grid_thw"],
                mm_token_type_ids=(ids == image_token).int())
