"""A vision-language model (LLaVA: CLIP vision tower, projector, Llama-family decoder) reads images: its greedy
tokens equal transformers' on the same weights and pixels, whole or in prefill chunks that cut an image; its
images are prepared as transformers' CLIP image processor prepares them; the prefix cache tells images apart; and
prompts whose placeholders and images disagree are refused."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from llmserve import LLM
from llmserve.errors import InvalidRequestError, ModelLoadError
from llmserve.multimodal.images import ImageProcessor
from llmserve.sampling.params import SamplingParams
from tests.hf_reference import build_llava, greedy_with_images, load_llava

transformers = pytest.importorskip("transformers")

PROMPT = "<|begin_of_text|><|im_start|>user\n<image>\nwhat is in it<|im_end|>\n<|im_start|>assistant\n"
TWO_IMAGES = "<|begin_of_text|><|im_start|>user\n<image>\nthis one <image>\nand that<|im_end|>\n<|im_start|>assistant\n"
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def random_image(seed: int, size: tuple[int, int] = (80, 60)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    return build_llava(tmp_path_factory.mktemp("llava") / "model", tiny_llama_dir)


@pytest.fixture(scope="module")
def llm(llava_dir) -> LLM:
    return LLM(str(llava_dir), dtype="float32", num_kv_blocks=64)


def reference_tokens(model_dir: Path, prompt_ids: list[int], images: list[Image.Image]) -> list[int]:
    processor = ImageProcessor.from_dir(model_dir)
    pixels = torch.from_numpy(np.stack([processor(image) for image in images]))
    return greedy_with_images(load_llava(model_dir), prompt_ids, pixels, GREEDY.max_tokens)


@pytest.mark.parametrize("size", [(80, 60), (56, 56), (40, 90), (337, 500), (20, 30)])
def test_images_are_prepared_as_transformers_clip_image_processor_prepares_them(llava_dir, size):
    image = random_image(1, size)
    ours = ImageProcessor.from_dir(llava_dir)(image)
    theirs = transformers.CLIPImageProcessor.from_pretrained(llava_dir)(image, return_tensors="np")["pixel_values"][0]
    assert ours.shape == theirs.shape == (3, 56, 56)
    np.testing.assert_allclose(ours, theirs, atol=1e-6)


@pytest.mark.parametrize(("prompt", "num_images"), [(PROMPT, 1), (TWO_IMAGES, 2)])
def test_greedy_tokens_equal_transformers_with_the_same_images(llava_dir, llm, prompt, num_images):
    images = [random_image(seed) for seed in range(num_images)]
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, GREEDY)[0]
    assert out.prompt_token_ids.count(1024) == 16 * num_images  # each <image> as its 16 patches
    assert list(out.outputs[0].token_ids) == reference_tokens(llava_dir, list(out.prompt_token_ids), images)


def test_prefill_chunks_that_cut_images_give_the_same_tokens(llava_dir):
    """A 7-token step budget cuts both images (16 placeholders each) across three steps or more."""
    images = [random_image(3), random_image(4)]
    chunked = LLM(str(llava_dir), dtype="float32", max_num_batched_tokens=7, num_kv_blocks=64)
    out = chunked.generate({"prompt": TWO_IMAGES, "multi_modal_data": {"image": images}}, GREEDY)[0]
    assert list(out.outputs[0].token_ids) == reference_tokens(llava_dir, list(out.prompt_token_ids), images)
    assert not chunked.engine.core.runner.image_features  # each image's features dropped after its last chunk


def test_the_prefix_cache_reuses_an_image_only_for_the_same_image(llm):
    block_manager = llm.engine.core.block_manager
    llm.engine.core.reset_prefix_cache()
    first, again, other = random_image(5), random_image(5), random_image(6)
    png_again = png_bytes(again)  # the same pixels, encoded: the same image
    outs = [llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": [image]}}, GREEDY)[0]
            for image in (first, png_again, other)]
    num_prompt = len(outs[0].prompt_token_ids)
    assert outs[0].num_cached_tokens == 0
    assert outs[1].num_cached_tokens == (num_prompt - 1) // 16 * 16  # every whole block, the image's included
    assert outs[1].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert outs[2].num_cached_tokens == 0  # the first block holds image placeholders: another image, another block
    assert outs[2].outputs[0].token_ids != outs[0].outputs[0].token_ids
    assert block_manager.num_used_blocks == 0


def test_bfloat16_reads_images_through_the_steps_the_one_call_decoder_does_not_take(llava_dir):
    bf16 = LLM(str(llava_dir), dtype="bfloat16", num_kv_blocks=64)
    outs = [bf16.generate({"prompt": PROMPT, "multi_modal_data": {"image": [random_image(seed)]}}, GREEDY)[0]
            for seed in (7, 7, 8)]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids != outs[2].outputs[0].token_ids


@pytest.mark.parametrize(("variant", "options"), [
    ("full-two-layers-qwen2", dict(feature_layer=[-3, -1], strategy="full", text_case="qwen2")),
])
def test_other_feature_layers_strategies_and_decoders_equal_transformers(tmp_path, tiny_llama_dir, variant, options):
    model_dir = build_llava(tmp_path / variant, tiny_llama_dir, seed=1, **options)
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64)
    images = [random_image(9)]
    out = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": images}}, GREEDY)[0]
    assert out.prompt_token_ids.count(1024) == 17  # the class token kept
    assert list(out.outputs[0].token_ids) == reference_tokens(model_dir, list(out.prompt_token_ids), images)


@pytest.mark.parametrize(("prompt", "data", "message"), [
    (PROMPT, {"image": []}, "1 image placeholder tokens .* for 0 images"),
    (TWO_IMAGES, {"image": [b"png?"]}, "could not be decoded"),
    (PROMPT, {"image": [random_image(0), random_image(1)]}, "places for 1 images but 2 were sent"),
    (PROMPT, {"video": [random_image(0)]}, 'multi_modal_data takes {"image"'),
    (PROMPT, {"image": [random_image(0)] * 17}, "at most 16 images"),
])
def test_images_and_placeholders_that_disagree_are_refused(llm, prompt, data, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate({"prompt": prompt, "multi_modal_data": data}, GREEDY)
    assert llm.engine.core.block_manager.num_used_blocks == 0


def test_placeholders_without_images_and_images_for_a_text_model_are_refused(llm, tiny_llama_dir):
    with pytest.raises(InvalidRequestError, match="image placeholder tokens .* for 0 images"):
        llm.generate(PROMPT, GREEDY)  # text spelling the placeholder
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens would cut"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": random_image(0)}},
                     SamplingParams(max_tokens=4, truncate_prompt_tokens=8))
    with pytest.raises(InvalidRequestError, match="use_beam_search does not take images"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": random_image(0)}},
                     SamplingParams(max_tokens=4, use_beam_search=True, n=2, temperature=0))
    text_only = LLM(str(tiny_llama_dir), num_kv_blocks=16, max_model_len=256)
    with pytest.raises(InvalidRequestError, match="reads text only"):
        text_only.generate({"prompt": "hi", "multi_modal_data": {"image": random_image(0)}}, GREEDY)


def test_a_processor_that_makes_images_the_tower_does_not_read_is_refused_at_start(llava_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in llava_dir.iterdir():
        (broken / path.name).symlink_to(path)
    (broken / "preprocessor_config.json").unlink()
    (broken / "preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 64},
                                                                 "crop_size": {"height": 64, "width": 64}}))
    with pytest.raises(ModelLoadError, match="the vision tower reads 56x56"):
        LLM(str(broken), dtype="float32", num_kv_blocks=64)


def test_the_memory_profiling_step_runs_the_vision_tower_on_as_many_images_as_its_tokens_hold(llm, monkeypatch):
    runner = llm.engine.core.runner
    seen: list[tuple[int, ...]] = []
    embed = runner.model.embed_image
    monkeypatch.setattr(runner.model, "embed_image",
                        lambda pixels, size: seen.append((tuple(pixels.shape), size)) or embed(pixels, size))
    runner.run_profile_step()
    budget = llm.engine.core.config.max_num_batched_tokens
    assert seen == [((3, 56, 56), (56, 56))] * (budget // 16) and not runner.image_features


def test_published_llava_configs_give_their_decoders_fields_by_transformers_defaults():
    """llava-1.5-7b-hf's and llava-v1.6-mistral-7b-hf's config.json name only what differs from their decoder's
    defaults in their text_config."""
    from llmserve.model.config import ModelConfig

    config = ModelConfig.from_dict({
        "architectures": ["LlavaForConditionalGeneration"], "image_token_index": 32000, "model_type": "llava",
        "projector_hidden_act": "gelu", "torch_dtype": "float16", "vocab_size": 32064,
        "text_config": {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096, "model_type": "llama",
                        "rms_norm_eps": 1e-05, "torch_dtype": "float16", "vocab_size": 32064},
        "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                          "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                          "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default"})
    assert (config.architecture, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
            config.intermediate_size, config.vocab_size, config.max_position_embeddings, config.dtype) == (
        "LlavaForConditionalGeneration", 4096, 32, 32, 11008, 32064, 4096, torch.float16)
    mistral = ModelConfig.from_dict({  # llava-v1.6-mistral-7b-hf's
        "architectures": ["LlavaNextForConditionalGeneration"], "image_token_index": 32000, "model_type": "llava_next",
        "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
        "text_config": {"architectures": ["MistralForCausalLM"], "intermediate_size": 14336,
                        "max_position_embeddings": 32768, "model_type": "mistral", "num_key_value_heads": 8,
                        "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
                        "torch_dtype": "bfloat16", "vocab_size": 32064},
        "torch_dtype": "float16", "vision_config": {"model_type": "clip_vision_model"}})
    assert (mistral.model_type, mistral.hidden_size, mistral.num_hidden_layers, mistral.num_attention_heads,
            mistral.num_key_value_heads, mistral.sliding_window, mistral.rope.theta, mistral.dtype) == (
        "mistral", 4096, 32, 32, 8, None, 1000000.0, torch.bfloat16)


@pytest.mark.parametrize("layout", ["published", "transformers-4.52"])
def test_checkpoints_in_either_published_weight_layout_load_the_same(llava_dir, tmp_path, layout):
    """llava-hf's checkpoints (`language_model.model.`, `vision_tower.vision_model.`) and those of transformers
    4.52 on (`model.language_model.`, `model.vision_tower.`, `lm_head.`) give the same tokens."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(llava_dir / "model.safetensors"))

    def renamed(name: str) -> str:
        if layout == "published":
            return name.replace("vision_tower.", "vision_tower.vision_model.")
        if name.startswith("language_model.lm_head."):
            return name.removeprefix("language_model.")
        return "model." + name.replace("language_model.model.", "language_model.")

    moved = tmp_path / layout
    moved.mkdir()
    for path in llava_dir.iterdir():
        if path.name != "model.safetensors":
            (moved / path.name).symlink_to(path)
    save_file({renamed(name): tensor for name, tensor in weights.items()}, str(moved / "model.safetensors"))
    images = {"image": [random_image(2)]}
    base = LLM(str(llava_dir), dtype="float32", num_kv_blocks=64).generate(
        {"prompt": PROMPT, "multi_modal_data": images}, GREEDY)[0]
    other = LLM(str(moved), dtype="float32", num_kv_blocks=64).generate(
        {"prompt": PROMPT, "multi_modal_data": images}, GREEDY)[0]
    assert other.outputs[0].token_ids == base.outputs[0].token_ids


def test_the_built_in_llava_is_a_checkpoint_transformers_reads_the_same(tmp_path):
    from llmserve.model.builtin_llava import make_llava

    model_dir = make_llava(tmp_path / "llava", "tiny", seed=0)
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=128)
    prompt = llm.engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this"}]}],
        add_generation_prompt=True)
    tokens = []
    for seed in (1, 2):
        image = random_image(seed)
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": [image]}}, GREEDY)[0]
        assert list(out.outputs[0].token_ids) == reference_tokens(model_dir, list(out.prompt_token_ids), [image])
        tokens.append(out.outputs[0].token_ids)
    assert tokens[0] != tokens[1]


def test_two_tensor_parallel_ranks_read_images_as_transformers_does(llava_dir):
    """The decoder split over two ranks, the vision tower whole on each, behind the engine core's process (the
    images go to it in the request)."""
    images = [random_image(21), random_image(22)]
    prompt_ids, tokens = generate_on_two_ranks(llava_dir, TWO_IMAGES, images, GREEDY)
    assert tokens == reference_tokens(llava_dir, prompt_ids, images)


def generate_on_two_ranks(model_dir: Path, prompt: str, images: list, params: SamplingParams
                          ) -> tuple[list[int], list[int]]:
    """The prompt and generated token ids of a prompt with images, on two tensor-parallel ranks behind the engine
    core's process (20-token steps: prefill chunks cut the images); no block left in use."""
    import asyncio

    from llmserve.config import EngineConfig
    from llmserve.engine.async_llm import AsyncLLM
    from llmserve.server.streaming import final_outputs

    async def run() -> tuple[list[int], list[int]]:
        engine = AsyncLLM.from_config(EngineConfig(model=str(model_dir), dtype="float32", device="cpu",
                                                   tensor_parallel_size=2, num_kv_blocks=64, max_num_batched_tokens=20))
        try:
            with_images = engine.input_processor.with_images(prompt, images)
            [output] = await final_outputs([await engine.add_request("r", with_images, params)])
            assert (await engine.stats()).num_used_blocks == 0
            return list(output.prompt_token_ids), list(output.outputs[0].token_ids)
        finally:
            engine.close()

    return asyncio.run(run())


def test_requests_preempted_and_recomputed_read_their_images_again(llava_dir, llm):
    """Four two-image prompts in a pool too small for all of them: the preempted ones recompute their prompts,
    images included, to the tokens they get alone."""
    batch = [{"prompt": TWO_IMAGES, "multi_modal_data": {"image": [random_image(30 + i), random_image(40 + i)]}}
             for i in range(4)]
    alone = [out.outputs[0].token_ids for out in llm.generate(batch, GREEDY)]
    tight = LLM(str(llava_dir), dtype="float32", num_kv_blocks=12, max_model_len=160, max_num_batched_tokens=48)
    squeezed = tight.generate(batch, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    assert tight.engine.core.scheduler.num_preemptions > 0
    assert [out.outputs[0].token_ids[:16] for out in squeezed] == alone
    assert tight.engine.core.block_manager.num_used_blocks == 0


@pytest.fixture(scope="module")
def llava_next_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    from tests.hf_reference import build_llava_next

    return build_llava_next(tmp_path_factory.mktemp("llava-next") / "model", tiny_llama_dir)


@pytest.mark.parametrize("size", [(80, 50), (40, 130), (200, 200), (57, 56), (300, 90)])
def test_llava_next_images_are_tiled_as_transformers_llava_next_processor_tiles_them(llava_next_dir, size):
    image = random_image(5, size)
    ours = ImageProcessor.from_dir(llava_next_dir)(image)
    theirs = transformers.LlavaNextImageProcessorPil.from_pretrained(llava_next_dir)(image, return_tensors="np")
    assert ours.shape == theirs["pixel_values"][0].shape
    np.testing.assert_allclose(ours, theirs["pixel_values"][0], atol=1e-6)


@pytest.mark.parametrize("step_tokens", [1024, 7])
def test_llava_next_greedy_tokens_equal_transformers_for_images_of_other_shapes(llava_next_dir, step_tokens):
    """A wide and a tall image take other numbers of tokens (their tiles cut back to their own ratio, a newline
    after each row); whole or in prefill chunks of 7 tokens, the tokens are transformers'."""
    images = [random_image(1, (80, 50)), random_image(2, (40, 130))]
    llm = LLM(str(llava_next_dir), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=step_tokens)
    out = llm.generate({"prompt": TWO_IMAGES, "multi_modal_data": {"image": images}}, GREEDY)[0]
    assert [image.length for image in llm.engine.input_processor.with_images(TWO_IMAGES, images).images] == [44, 76]
    processor = transformers.LlavaNextImageProcessorPil.from_pretrained(llava_next_dir)(images, return_tensors="pt")
    from tests.hf_reference import load_llava_next

    model, generated = load_llava_next(llava_next_dir), []
    with torch.no_grad():
        step = model(input_ids=torch.tensor([list(out.prompt_token_ids)]), pixel_values=processor["pixel_values"],
                     image_sizes=processor["image_sizes"], use_cache=True)
        for _ in range(GREEDY.max_tokens):
            generated.append(int(step.logits[0, -1].argmax()))
            step = model(input_ids=torch.tensor([[generated[-1]]]), past_key_values=step.past_key_values,
                         use_cache=True)
    assert list(out.outputs[0].token_ids) == generated
    assert llm.engine.core.block_manager.num_used_blocks == 0


def test_an_earlier_turns_images_dropped_with_it_leave_the_last_images_in_place():
    """Fitting a conversation to the context drops its earliest turns: the placeholders left are the last images'."""
    from llmserve.multimodal.inputs import PreparedImage, expand_placeholders, image_prompt, placed_images

    images = [PreparedImage(np.full((3, 2, 2), i, dtype=np.float32), bytes([i]) * 16, (2, 2), n, n)
              for i, n in enumerate((3, 2, 4))]
    ids = expand_placeholders([7, 9, 8, 9, 6], 9, [2, 4])  # the turn with the first image was dropped
    kept = placed_images(ids, images, 9)
    assert [image.num_tokens for image in kept] == [2, 4]
    prompt = image_prompt(ids, kept, 9)
    assert [(image.offset, image.length) for image in prompt.images] == [(1, 2), (4, 4)]
    with pytest.raises(InvalidRequestError, match="placeholders do not match"):
        placed_images([7, 9, 9, 9], images, 9)  # no run of the last images fills 3


def test_limit_mm_per_prompt_bounds_the_images_of_a_prompt(llava_dir):
    """vLLM's --limit-mm-per-prompt: {"image": N}; 0 reads no images; anything else is refused at start."""
    import argparse

    from llmserve.config import EngineConfig, add_engine_args

    one = LLM(str(llava_dir), dtype="float32", num_kv_blocks=64, limit_mm_per_prompt={"image": 1})
    assert one.generate({"prompt": PROMPT, "multi_modal_data": {"image": [random_image(0)]}}, GREEDY)
    with pytest.raises(InvalidRequestError, match="at most 1 images here"):
        one.generate({"prompt": TWO_IMAGES, "multi_modal_data": {"image": [random_image(0)] * 2}}, GREEDY)
    none = LLM(str(llava_dir), dtype="float32", num_kv_blocks=64, limit_mm_per_prompt={"image": 0})
    with pytest.raises(InvalidRequestError, match="at most 0 images here"):
        none.generate({"prompt": PROMPT, "multi_modal_data": {"image": [random_image(0)]}}, GREEDY)
    for wrong in ({"video": 1}, {"image": -1}, {"image": "2"}):
        with pytest.raises(ValueError, match="limit_mm_per_prompt"):
            EngineConfig(model=str(llava_dir), limit_mm_per_prompt=wrong).validate()
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--limit-mm-per-prompt", '{"image": 2}']).limit_mm_per_prompt == {"image": 2}


def test_a_text_draft_model_of_a_smaller_vocabulary_drafts_for_prompts_with_images(llava_dir, llm, tiny_llama_dir):
    """The tiny Llama (1,024 tokens) drafts for the LLaVA (1,032 with `<image>` at 1,024): the placeholders, past
    its vocabulary, read as token 0 to it, and the served model's verification keeps the tokens it gives alone."""
    images = {"image": [random_image(50), random_image(51)]}
    alone = llm.generate({"prompt": TWO_IMAGES, "multi_modal_data": images}, GREEDY)[0].outputs[0].token_ids
    drafted = LLM(str(llava_dir), dtype="float32", num_kv_blocks=64,
                  speculative_config={"model": str(tiny_llama_dir), "num_speculative_tokens": 3})
    out = drafted.generate({"prompt": TWO_IMAGES, "multi_modal_data": images}, GREEDY)[0]
    assert out.outputs[0].token_ids == alone
    assert drafted.engine.core.block_manager.num_used_blocks == 0


def test_the_features_of_a_request_ended_mid_image_are_dropped_once_a_steps_worth_is_kept(llava_dir):
    """A request aborted between the prefill chunks of its image leaves the image's features behind; the next steps
    keep them only while what is kept stays within a step's worth of rows (7 here: they are 16)."""
    llm = LLM(str(llava_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=7)
    engine, runner = llm.engine, llm.engine.core.runner
    processor = engine.input_processor
    engine.add_request("left", processor.with_images(PROMPT, [random_image(60)]), GREEDY)
    while not runner.image_features:
        engine.step()
    (left,) = runner.image_features
    engine.abort_request(["left"])
    engine.add_request("next", processor.with_images(PROMPT, [random_image(61)]), GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert left not in runner.image_features and not runner.image_features
    engine.check_invariants()


def test_a_steps_images_stay_within_its_token_budget_and_the_chunk_that_cannot_afford_one_waits(
        llava_dir, llm, monkeypatch):
    """Three prompts that start with an image (16 placeholders) under a 30-token step: the first prompt's chunk takes
    its image; the second's, which would start a second image in the same step (32 image tokens), stops before it and
    reads it in the next step; no step computes more than 30 image tokens. The tokens are each prompt's alone."""
    prompt = "<|begin_of_text|><image>\nwhat is it<|im_end|>\n<|im_start|>assistant\n"
    images = [random_image(70 + i) for i in range(3)]
    budgeted = LLM(str(llava_dir), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=30)
    engine, runner = budgeted.engine, budgeted.engine.core.runner
    computed: list[int] = []
    embed = runner.model.embed_image
    monkeypatch.setattr(runner.model, "embed_image",
                        lambda pixels, size: computed.append(len(features := embed(pixels, size))) or features)
    for i, image in enumerate(images):
        engine.add_request(f"r{i}", engine.input_processor.with_images(prompt, [image]), GREEDY)
    per_step, tokens = [], {}
    while engine.has_unfinished_requests():
        before = len(computed)
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = list(output.outputs[0].token_ids)
        per_step.append(sum(computed[before:]))
    assert per_step[0] == 16 and max(per_step) <= 30 and sum(per_step) == 3 * 16
    alone = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": [image]}} for image in images], GREEDY)
    assert [tokens[f"r{i}"] for i in range(3)] == [list(out.outputs[0].token_ids) for out in alone]
    engine.check_invariants()
