"""Qwen2-VL and Qwen2.5-VL read images: an image's tokens turn the decoder's rotary embedding by their (temporal,
height, width) ids and the text after it continues from the longer side of its grid (M-RoPE). Greedy tokens equal
transformers' on the same weights and images: one image or several of different shapes, whole or in prefill chunks
that cut them, generating well past the prompt (decode positions lag their indexes), on one rank or two."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from llmserve import LLM
from llmserve.model.config import ModelConfig
from llmserve.multimodal.images import ImageProcessor, QwenImageProcessor
from llmserve.sampling.params import SamplingParams
from tests.engine.test_vision import generate_on_two_ranks
from tests.hf_reference import build_qwen2_vl, greedy_with_images, load_qwen2_vl, qwen2_vl_inputs

transformers = pytest.importorskip("transformers")

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"<|begin_of_text|><|im_start|>user\n{IMAGE}what is in it<|im_end|>\n<|im_start|>assistant\n"
TWO_IMAGES = (f"<|begin_of_text|><|im_start|>user\n{IMAGE}this one, {IMAGE}and that<|im_end|>\n"
              "<|im_start|>assistant\n")
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def random_image(seed: int, size: tuple[int, int]) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    return build_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl") / "model", tiny_llama_dir)


@pytest.fixture(scope="module")
def qwen25_vl_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    return build_qwen2_vl(tmp_path_factory.mktemp("qwen25_vl") / "model", tiny_llama_dir, seed=3, version="2.5")


@pytest.fixture(scope="module")
def llm(qwen2_vl_dir) -> LLM:
    return LLM(str(qwen2_vl_dir), dtype="float32", num_kv_blocks=64)


def reference_tokens(model_dir: Path, prompt_ids: list[int], images: list[Image.Image]) -> list[int]:
    inputs = qwen2_vl_inputs(model_dir, prompt_ids, images)
    return greedy_with_images(load_qwen2_vl(model_dir), prompt_ids, inputs.pop("pixel_values"), GREEDY.max_tokens,
                              **inputs)


def generate(llm: LLM, prompt: str, images: list[Image.Image]):
    return llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, GREEDY)[0]


@pytest.mark.parametrize(("prompt", "sizes"), [
    (PROMPT, [(150, 90)]),  # 5x3 tokens: text after it continues 5 positions on, not 15
    (PROMPT, [(60, 200)]),  # 2x7: taller than wide
    (TWO_IMAGES, [(100, 100), (250, 60)]),
])
def test_greedy_tokens_equal_transformers_with_the_same_images(qwen2_vl_dir, llm, prompt, sizes):
    images = [random_image(seed, size) for seed, size in enumerate(sizes)]
    out = generate(llm, prompt, images)
    processor = ImageProcessor.from_dir(qwen2_vl_dir)
    assert isinstance(processor, QwenImageProcessor)
    assert out.prompt_token_ids.count(1024) == sum(processor.num_tokens((i.height, i.width)) for i in images)
    assert list(out.outputs[0].token_ids) == reference_tokens(qwen2_vl_dir, list(out.prompt_token_ids), images)


def test_the_images_change_the_tokens(llm):
    """The image tokens are read (features and positions): another image gives other tokens."""
    first = generate(llm, PROMPT, [random_image(1, (150, 90))]).outputs[0].token_ids
    second = generate(llm, PROMPT, [random_image(2, (150, 90))]).outputs[0].token_ids
    wider = generate(llm, PROMPT, [random_image(1, (300, 45))]).outputs[0].token_ids
    assert first != second and first != wider


def test_prefill_chunks_that_cut_images_give_the_same_tokens(qwen2_vl_dir):
    """16-token steps cut the first image (12 tokens) and the text between and after them (an image takes no more
    than a step's tokens, so it is cut where it does not start a step)."""
    images = [random_image(3, (120, 90)), random_image(4, (60, 60))]
    chunked = LLM(str(qwen2_vl_dir), dtype="float32", max_num_batched_tokens=16, num_kv_blocks=64)
    out = generate(chunked, TWO_IMAGES, images)
    first = out.prompt_token_ids.index(1024)
    assert out.prompt_token_ids.count(1024) == 16 and first // 16 != (first + 11) // 16
    assert list(out.outputs[0].token_ids) == reference_tokens(qwen2_vl_dir, list(out.prompt_token_ids), images)
    assert not chunked.engine.core.runner.image_features


def test_no_image_is_resized_past_a_steps_tokens(qwen2_vl_dir):
    """An image is encoded in one pass, which the memory profile's step bounds: with 16-token steps an image the
    processor would give 48 tokens is read at 16 or fewer."""
    small_steps = LLM(str(qwen2_vl_dir), dtype="float32", max_num_batched_tokens=16, num_kv_blocks=64)
    out = generate(small_steps, PROMPT, [random_image(5, (400, 300))])
    assert 0 < out.prompt_token_ids.count(1024) <= 16
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens


def test_qwen25_vl_greedy_tokens_equal_transformers(qwen25_vl_dir):
    """Qwen2.5-VL: windowed attention in the tower (a window of 2x2 tokens; a 5x3 grid that windows do not divide)."""
    llm = LLM(str(qwen25_vl_dir), dtype="float32", num_kv_blocks=64)
    images = [random_image(6, (150, 90)), random_image(7, (90, 200))]
    out = generate(llm, TWO_IMAGES, images)
    assert list(out.outputs[0].token_ids) == reference_tokens(qwen25_vl_dir, list(out.prompt_token_ids), images)


def test_two_tensor_parallel_ranks_behind_the_core_process_read_images_as_transformers_does(qwen2_vl_dir):
    """The decoder split over two ranks, each writing the image tokens' rotary rows; the requests' images and the
    steps' position lags go to the core's process and its workers."""
    images = [random_image(8, (150, 90)), random_image(10, (60, 120))]
    prompt_ids, tokens = generate_on_two_ranks(qwen2_vl_dir, TWO_IMAGES, images, GREEDY)
    assert tokens == reference_tokens(qwen2_vl_dir, prompt_ids, images)


def test_the_prefix_cache_reuses_an_image_and_the_positions_after_it(llm):
    """A prompt repeated with the same image reads its blocks (positions included) from the cache: the same tokens."""
    llm.engine.core.reset_prefix_cache()
    images = [random_image(9, (150, 90))]
    first = generate(llm, PROMPT, images)
    hits = llm.engine.core.block_manager.prefix_hits
    again = generate(llm, PROMPT, images)
    assert llm.engine.core.block_manager.prefix_hits > hits
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.engine.core.block_manager.num_used_blocks == 0


def test_published_qwen2_vl_configs_load():
    """Qwen2-VL-7B-Instruct's config.json: the decoder's fields at the top level, M-RoPE in `rope_scaling`."""
    config = ModelConfig.from_dict({
        "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "hidden_size": 3584,
        "intermediate_size": 18944, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "vocab_size": 152064,
        "sliding_window": 32768, "use_sliding_window": False, "torch_dtype": "bfloat16", "image_token_id": 151655,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                          "hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}})
    assert (config.hidden_size, config.num_key_value_heads, config.attention_bias, config.sliding_window,
            config.rope.rope_type, config.rope.mrope_section, config.dtype) == (
        3584, 4, True, None, "default", (16, 24, 24), torch.bfloat16)


def test_the_built_in_qwen2_vl_reads_an_image_as_transformers_does(tmp_path):
    """`make-model --arch qwen2_vl`: transformers loads it as Qwen2VLForConditionalGeneration, and a chat with an
    image gives its greedy tokens (the zero q, k and v biases, the scaled M-RoPE sections, the tower)."""
    from llmserve.model.builtin_qwen2_vl import make_qwen2_vl

    model_dir = make_qwen2_vl(tmp_path / "qwen2_vl", "tiny")
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=1024)
    image = random_image(12, (200, 150))
    prompt = llm.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it"}]}],
        add_generation_prompt=True)
    out = generate(llm, prompt, [image])
    image_token = json.loads((model_dir / "config.json").read_text())["image_token_id"]
    inputs = qwen2_vl_inputs(model_dir, list(out.prompt_token_ids), [image], image_token)
    expected = greedy_with_images(load_qwen2_vl(model_dir), list(out.prompt_token_ids), inputs.pop("pixel_values"),
                                  GREEDY.max_tokens, **inputs)
    assert out.prompt_token_ids.count(image_token) == 35  # 196x140 pixels: 7x5 tokens
    assert list(out.outputs[0].token_ids) == expected


def test_preempted_requests_and_speculated_tokens_keep_their_positions(qwen2_vl_dir, llm):
    """Prompts preempted and recomputed, and n-gram drafts verified after an image, take the positions they take
    alone without drafts (the lag of every token after an image, drafts' included)."""
    batch = [{"prompt": TWO_IMAGES, "multi_modal_data": {"image": [random_image(30 + i, (150, 90)),
                                                                  random_image(40 + i, (60, 120))]}}
             for i in range(4)]
    alone = [out.outputs[0].token_ids for out in llm.generate(batch, GREEDY)]
    tight = LLM(str(qwen2_vl_dir), dtype="float32", num_kv_blocks=14, max_model_len=160, max_num_batched_tokens=48)
    assert [out.outputs[0].token_ids for out in tight.generate(batch, GREEDY)] == alone
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert tight.engine.core.block_manager.num_used_blocks == 0
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    speculating = LLM(str(qwen2_vl_dir), dtype="float32", num_kv_blocks=64, speculative_config=ngram)
    assert [out.outputs[0].token_ids for out in speculating.generate(batch, GREEDY)] == alone
    assert speculating.engine.core.scheduler.spec.num_draft_tokens > 0


def test_int8_weights_read_images(qwen2_vl_dir):
    """Weight-only int8 at load quantizes the decoder's linear layers; the tower stays as it was: an image still
    changes the tokens, and the run frees its blocks."""
    int8 = LLM(str(qwen2_vl_dir), dtype="float32", num_kv_blocks=64, quantization="int8")
    first = generate(int8, PROMPT, [random_image(1, (150, 90))]).outputs[0].token_ids
    second = generate(int8, PROMPT, [random_image(2, (150, 90))]).outputs[0].token_ids
    assert len(first) == GREEDY.max_tokens and first != second
    assert int8.engine.core.block_manager.num_used_blocks == 0
