"""What an image costs a vision-language model's request, on the built-in LLaVA (`make-model --arch llava`; at
`medium`, LLaVA-1.5's own vision tower, CLIP ViT-L/14 at 336 pixels, 576 tokens an image, before the 348.7M
built-in medium Llama) or Qwen2-VL (`--arch qwen2_vl`; at `medium`, Qwen2-VL's own 675M tower, which reads the
picture at about its own resolution, before the same decoder with M-RoPE), in bfloat16, at batch 1:

  - `prepare`: a 1024x768 JPEG decoded, resized, cropped and normalised (the API process's work, on a worker);
  - `encode`: the vision tower and projector on one image (the engine's, in the image's first prefill step), and
    `encode torch` the same with torch's own linear layers (`F.linear`) in place of `VisionLinear`'s;
  - `ttft image` against `ttft text`: the time to a first token of a prompt of one image and a question (the
    image prepared, encoded and its tokens prefilled), and of a text prompt of as many tokens;
  - `ttft cached`: the same image's prompt again, its blocks in the prefix cache (the image is prepared to be
    named, but not encoded, and its tokens are not computed again).

Rounds alternate the cases; each image is new to the cache except in `cached`.

    python benchmarks/vision.py --size medium --rounds 5 [--arch qwen2_vl]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.model.builtin_llava import make_llava  # noqa: E402
from llmserve.model.builtin_qwen2_vl import make_qwen2_vl  # noqa: E402
from llmserve.model.layers import VisionLinear  # noqa: E402
from llmserve.multimodal.images import prepare  # noqa: E402

QUESTION = [{"type": "image"}, {"type": "text", "text": "What is in this picture, and what is it for?"}]
FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1)


def photo(seed: int, size: tuple[int, int] = (1024, 768)) -> bytes:
    """A JPEG of smooth random colour (photo-like to the codec), `size` (width, height)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
    image = Image.fromarray(small).resize(size, Image.Resampling.BICUBIC)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue()


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def encode_with_torch_linear(model: torch.nn.Module, pixels: torch.Tensor, size: tuple[int, int]) -> float:
    """Seconds of `encode` with the tower's linear layers as torch's own (`F.linear`), the baseline of
    `VisionLinear`."""
    ours = VisionLinear.forward
    VisionLinear.forward = torch.nn.Linear.forward
    try:
        return seconds(lambda: model.embed_image(pixels, size))
    finally:
        VisionLinear.forward = ours


@torch.inference_mode()
def one_round(llm: LLM, prompt: str, text_ids: list[int], jpeg: bytes) -> dict[str, float]:
    """Seconds of each case, the image new to the prefix cache but in `cached`."""
    processor, core = llm.engine.input_processor.vision.processor, llm.engine.core
    prepared = prepare(processor, jpeg, "image", llm.engine.input_processor.vision.num_tokens)
    pixels = torch.from_numpy(prepared.pixels)
    image_prompt = {"prompt": prompt, "multi_modal_data": {"image": [jpeg]}}
    times = {
        "prepare": seconds(lambda: prepare(processor, jpeg, "image", llm.engine.input_processor.vision.num_tokens)),
        "encode": seconds(lambda: core.runner.model.embed_image(pixels, prepared.size)),
        "encode torch": encode_with_torch_linear(core.runner.model, pixels, prepared.size),
        "ttft image": seconds(lambda: llm.generate(image_prompt, FIRST_TOKEN)),
        "ttft cached": seconds(lambda: llm.generate(image_prompt, FIRST_TOKEN)),
    }
    core.reset_prefix_cache()
    times["ttft text"] = seconds(lambda: llm.generate([{"prompt_token_ids": text_ids}], FIRST_TOKEN))
    core.reset_prefix_cache()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="llava", choices=["llava", "qwen2_vl"])
    parser.add_argument("--size", default="medium", choices=["tiny", "small", "medium"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--image-size", default="1024x768", help="the pictures' WIDTHxHEIGHT")
    args = parser.parse_args()
    size = tuple(int(side) for side in args.image_size.split("x"))
    make = make_llava if args.arch == "llava" else make_qwen2_vl
    model_dir = make(Path(tempfile.mkdtemp()) / args.arch, args.size)
    llm = LLM(model=str(model_dir), dtype=args.dtype)
    processor = llm.engine.input_processor
    prompt = llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                                      add_generation_prompt=True)
    image_ids = processor.with_images(prompt, [photo(0, size)])
    text_ids = [5 + (7 * i) % 900 for i in range(len(image_ids))]  # as many tokens, none an image's
    runs: dict[str, list[float]] = {name: [] for name in ("prepare", "encode", "encode torch", "ttft image",
                                                          "ttft cached", "ttft text")}
    for round_ in range(args.rounds + 1):  # round 0 warms up
        times = one_round(llm, prompt, text_ids, photo(round_ + 1, size))
        if round_:
            for name, value in times.items():
                runs[name].append(value)
    print(f"built-in {args.arch}-{args.size}, {args.dtype}, a {args.image_size} JPEG, {len(image_ids)} prompt tokens "
          f"({image_ids.images[0].length} of them the image's), {args.rounds} rounds, torch threads "
          f"{torch.get_num_threads()}")
    for name, values in runs.items():
        print(f"  {name:12s} median {statistics.median(values) * 1e3:8.1f} ms  (min {min(values) * 1e3:.1f}, "
              f"max {max(values) * 1e3:.1f})")
    text, image = statistics.median(runs["ttft text"]), statistics.median(runs["ttft image"])
    encode = statistics.median(runs["encode"])
    print(f"  encode torch / encode = {statistics.median(runs['encode torch']) / encode:.2f}")
    print(f"  ttft image / ttft text = {image / text:.2f}; ttft cached / ttft image = "
          f"{statistics.median(runs['ttft cached']) / image:.2f}")


if __name__ == "__main__":
    main()
