"""What both sides of the engine need to know about the model before anything runs: where it is, its
configuration, its generation defaults, the tokens that end a sequence, the context limit, and
whether it generates and how it embeds.

The front end reads them (it has the tokenizer) and hands them to the engine core once, at start.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmserve.config import DEFAULT_STEP_TOKENS, ENCODER_STEP_TOKENS, EngineConfig
from llmserve.errors import InvalidRequestError, ModelLoadError
from llmserve.model.clip import VisionConfig
from llmserve.model.config import ModelConfig
from llmserve.model.loader import resolve_model_path
from llmserve.model.pooling import ClassifierConfig, PoolerConfig, classifier_config, pooler_config
from llmserve.model.registry import model_class
from llmserve.multimodal.images import ImageProcessor, QwenImageProcessor, anyres_num_tokens
from llmserve.plugins import load_plugins
from llmserve.tokenizer.tokenizer import Tokenizer, read_chat_template

logger = logging.getLogger(__name__)


@dataclass
class DraftFacts:
    """Speculative decoding's draft model (`speculative_config` with a `model`)."""

    model_dir: Path
    model_config: ModelConfig
    max_model_len: int  # the served model's, or less where the draft's positions end sooner


@dataclass
class VisionFacts:
    """A vision-language model's images: the token its chat template writes for each, how its pixels are prepared,
    how many tokens each takes in the prompt (LLaVA's as many as its tower's patches, and its class token with the
    "full" feature strategy; LLaVA-NeXT's as many as its tiles' patches keep of the image, one more for each row,
    and the whole image's patches; Qwen2-VL's one per 28x28 pixels at the size it is resized to), and how many
    positions it moves its sequence on (Qwen2-VL's M-RoPE: the longer side of its token grid; others: its tokens)."""

    image_token_id: int
    processor: ImageProcessor | QwenImageProcessor
    patches_per_side: int = 0  # LLaVA's tower's
    class_token: bool = False
    pixel_limit: int | None = None  # Qwen2-VL's: the most pixels an image is resized to (a step's tokens)

    def with_options(self, options: Mapping[str, Any], param: str) -> VisionFacts:
        """These facts under a request's image processor options (vLLM's `mm_processor_kwargs`): Qwen2-VL's
        `min_pixels` and `max_pixels` (up to `pixel_limit`); a 400 naming any other option, or a value out of range."""
        processor = self.processor
        names = ("min_pixels", "max_pixels") if isinstance(processor, QwenImageProcessor) else ()
        for name, value in options.items():
            if name not in names:
                takes = f"takes {' and '.join(names)}" if names else "takes none"
                raise InvalidRequestError(f"{name!r} is not an option of this model's image processor (it {takes}).",
                                          param=f"{param}.{name}")
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(f"{name} must be a positive integer.", param=f"{param}.{name}")
        if not options:
            return self
        assert isinstance(processor, QwenImageProcessor)
        one_token, limit = processor.factor**2, self.pixel_limit or processor.max_pixels
        for name, least in (("max_pixels", one_token), ("min_pixels", 1)):
            if name in options and not least <= options[name] <= limit:
                raise InvalidRequestError(
                    f"{name} must be between {least} and {limit} (a step's tokens: raise --max-num-batched-tokens to "
                    "read images larger).", param=f"{param}.{name}")
        # One bound given: the other follows it where it must (a max below the default min lowers the min).
        max_pixels = options.get("max_pixels", max(processor.max_pixels, options.get("min_pixels", 0)))
        min_pixels = options.get("min_pixels", min(processor.min_pixels, max_pixels))
        if min_pixels > max_pixels:
            raise InvalidRequestError(f"min_pixels ({min_pixels}) is more than max_pixels ({max_pixels}).",
                                      param=f"{param}.min_pixels")
        return dataclasses.replace(self, processor=dataclasses.replace(processor, min_pixels=min_pixels,
                                                                       max_pixels=max_pixels))

    def num_tokens(self, size: tuple[int, int]) -> int:
        """The placeholder tokens an image of `size` (height, width) takes."""
        processor = self.processor
        if isinstance(processor, QwenImageProcessor):
            return processor.num_tokens(size)
        if processor.grid_pinpoints is None:
            return self.patches_per_side**2 + self.class_token
        assert processor.crop is not None
        return anyres_num_tokens(size, processor.grid_pinpoints, processor.crop[0], self.patches_per_side)

    def span(self, size: tuple[int, int]) -> int:
        """The positions an image of `size` moves its sequence on."""
        if isinstance(self.processor, QwenImageProcessor):
            return max(self.processor.grid(size))
        return self.num_tokens(size)


@dataclass
class ModelFacts:
    model_dir: Path
    model_config: ModelConfig
    generation_config: dict
    eos_token_ids: frozenset[int]
    max_model_len: int
    can_generate: bool = True  # False for an encoder or a classifier
    pooler: PoolerConfig | None = None  # how it embeds; None: it does not
    classifier: ClassifierConfig | None = None  # a sequence-classification model's labels; its "embeddings" are logits
    max_num_batched_tokens: int = 1024  # the engine's step budget (`step_token_budget`)
    draft: DraftFacts | None = None
    vision: VisionFacts | None = None  # None: it reads text only

    def settled(self, config: EngineConfig) -> EngineConfig:
        """`config` with the defaults the model decides filled in (the step budget), as both processes use it."""
        return dataclasses.replace(config, max_num_batched_tokens=self.max_num_batched_tokens)


def load_model(config: EngineConfig) -> tuple[ModelFacts, Tokenizer]:
    """Resolve the model (a local directory or a hub id), read its facts and load its tokenizer;
    fails fast on an unsupported architecture or an impossible max_model_len."""
    config.validate()
    load_plugins()
    model_dir = resolve_model_path(config.model, config.revision)
    chat_template = read_chat_template(config.chat_template) if config.chat_template is not None else None
    tokenizer = Tokenizer.from_pretrained(config.tokenizer or model_dir, chat_template)
    model_config = _with_classifier_tokens(ModelConfig.from_pretrained(model_dir, config.hf_overrides), tokenizer)
    cls = model_class(model_config.architecture)
    is_encoder = getattr(cls, "is_encoder", False)
    is_classifier = hasattr(cls, "classify")
    pooler = pooler_config(config, model_dir, is_encoder, is_classifier)
    generation_config = _read_json(model_dir / "generation_config.json")
    facts = ModelFacts(
        model_dir=model_dir,
        model_config=model_config,
        generation_config=generation_config,
        eos_token_ids=_eos_token_ids(model_config, generation_config, tokenizer),
        max_model_len=_max_model_len(config, model_config, pooler, _reserved_positions(cls, model_config)),
        can_generate=not is_encoder and not is_classifier,
        pooler=pooler,
        classifier=classifier_config(model_config.raw) if is_classifier else None,
    )
    facts.max_num_batched_tokens = step_token_budget(config, is_encoder, facts.max_model_len)
    facts.draft = _draft_facts(config, facts)
    facts.vision = (_vision_facts(model_dir, model_config, facts.max_num_batched_tokens)
                    if hasattr(cls, "embed_image") else None)
    return facts, tokenizer


def _vision_facts(model_dir: Path, model_config: ModelConfig, step_tokens: int) -> VisionFacts:
    """One `image_token_index` per image in the template; the image processor must give the tower's image size (and
    LLaVA-NeXT's the model's tiled resolutions), or Qwen2-VL's its patches."""
    raw = model_config.raw
    token = raw.get("image_token_id", raw.get("image_token_index"))
    if not isinstance(token, int) or not 0 <= token < model_config.vocab_size:
        raise ModelLoadError(f"config.json's image_token_index ({token!r}) is not a token of the model.")
    processor = ImageProcessor.from_dir(model_dir)
    if isinstance(processor, QwenImageProcessor):
        processor = _qwen_processor(processor, raw.get("vision_config") or {}, step_tokens)
        return VisionFacts(token, processor, pixel_limit=step_tokens * processor.factor**2)
    vision = VisionConfig.from_dict(raw.get("vision_config") or {})
    if processor.output_size() != (vision.image_size, vision.image_size):
        raise ModelLoadError(f"preprocessor_config.json makes images of {processor.output_size()} pixels; the vision "
                             f"tower reads {vision.image_size}x{vision.image_size}.")
    if raw.get("image_grid_pinpoints") and [list(p) for p in processor.grid_pinpoints or ()] != [
            list(p) for p in raw["image_grid_pinpoints"]]:
        raise ModelLoadError("preprocessor_config.json's image_grid_pinpoints are not config.json's.")
    full = raw.get("vision_feature_select_strategy", "default") == "full"
    return VisionFacts(token, processor, vision.image_size // vision.patch_size, full)


def _qwen_processor(processor: QwenImageProcessor, vision: dict, step_tokens: int) -> QwenImageProcessor:
    """Qwen2-VL's processor, checked against its tower, resizing no image past a step's tokens: an image's features
    are computed in one pass, which the memory profile's step bounds (vLLM's rule too)."""
    patch, merge = int(vision.get("patch_size", 14)), int(vision.get("spatial_merge_size", 2))
    if (processor.patch_size, processor.merge_size) != (patch, merge):
        raise ModelLoadError(f"preprocessor_config.json cuts {processor.patch_size}-pixel patches merged "
                             f"{processor.merge_size} by {processor.merge_size}; the vision tower reads {patch} and "
                             f"{merge}.")
    max_pixels = step_tokens * processor.factor**2
    if processor.max_pixels <= max_pixels:
        return processor
    logger.info("Images are resized to at most %d pixels (%d tokens, a step's; preprocessor_config.json allows %d); "
                "raise --max-num-batched-tokens to read them larger.", max_pixels, step_tokens, processor.max_pixels)
    return dataclasses.replace(processor, max_pixels=max_pixels, min_pixels=min(processor.min_pixels, max_pixels))


def _draft_facts(config: EngineConfig, facts: ModelFacts) -> DraftFacts | None:
    """The draft model's, checked: a generating decoder whose token ids the served model has too."""
    spec = config.speculative
    if spec is None or spec.model is None:
        return None
    if not facts.can_generate:
        raise ModelLoadError(f"Speculative decoding needs a generating model, not {facts.model_config.architecture}.")
    model_dir = resolve_model_path(spec.model, None)
    draft = ModelConfig.from_pretrained(model_dir)
    cls = model_class(draft.architecture)
    if getattr(cls, "is_encoder", False) or hasattr(cls, "classify"):
        raise ModelLoadError(f"The draft model must be a generating decoder, not {draft.architecture}.")
    if draft.vocab_size > facts.model_config.vocab_size:
        raise ModelLoadError(
            f"The draft model's vocabulary ({draft.vocab_size} tokens) is larger than the served model's "
            f"({facts.model_config.vocab_size}); a draft must share the served model's tokenizer."
        )
    limit = draft.max_position_embeddings - _reserved_positions(cls, draft)
    if draft.sliding_window:
        limit = min(limit, draft.sliding_window)
    return DraftFacts(model_dir, draft, min(facts.max_model_len, limit))


def _with_classifier_tokens(model_config: ModelConfig, tokenizer: Tokenizer) -> ModelConfig:
    """A causal LM scored as a classifier (vLLM's `classifier_from_token`, Qwen3-Reranker's way): the tokens'
    ids, for the loader to make the head from their rows of the language-model head, and the labels. Two
    tokens (["no", "yes"]) give one label, the second's logit less the first's (their 2-way softmax as a
    sigmoid); more give one label each."""
    tokens = model_config.raw.get("classifier_from_token")
    if tokens is None:
        return model_config
    if not isinstance(tokens, list) or len(tokens) < 2 or not all(isinstance(t, str) for t in tokens):
        raise ModelLoadError("classifier_from_token must name two or more tokens, e.g. [\"no\", \"yes\"].")
    ids = [tokenizer.token_to_id(token) for token in tokens]
    unknown = [token for token, token_id in zip(tokens, ids, strict=True) if token_id is None]
    if unknown:
        raise ModelLoadError(f"classifier_from_token: {unknown} are not tokens of the model's vocabulary.")
    labels = tokens[1:] if len(tokens) == 2 else tokens
    return ModelConfig.from_dict({**model_config.raw, "classifier_from_token_ids": ids,
                                  "id2label": {str(i): label for i, label in enumerate(labels)}})


def step_token_budget(config: EngineConfig, is_encoder: bool, max_model_len: int) -> int:
    """The configured step budget, else the default: a decoder's prompts are prefilled in chunks, but an
    encoder computes each input whole in one step, so its budget holds its whole context, and a larger one
    costs no KV memory while it batches many short inputs together (rerank and embedding requests)."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    return max(ENCODER_STEP_TOKENS, max_model_len) if is_encoder else DEFAULT_STEP_TOKENS


def _eos_token_ids(model_config: ModelConfig, generation_config: dict, tokenizer: Tokenizer) -> frozenset[int]:
    ids = set(model_config.eos_token_ids)
    gen_eos = generation_config.get("eos_token_id")
    ids.update([gen_eos] if isinstance(gen_eos, int) else gen_eos or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _reserved_positions(cls: type, model_config: ModelConfig) -> int:
    """Rows of the position table before a sequence's first position (RoBERTa's), never a token's."""
    offset = getattr(cls, "position_offset", None)
    return offset(model_config) if offset is not None else 0


def _max_model_len(
    config: EngineConfig, model_config: ModelConfig, pooler: PoolerConfig | None, reserved_positions: int
) -> int:
    limit = model_config.max_position_embeddings - reserved_positions
    if model_config.sliding_window:
        limit = min(limit, model_config.sliding_window)
    if config.max_model_len is None:
        if pooler is not None and pooler.max_seq_length:  # what sentence-transformers embeds at most
            return min(limit, pooler.max_seq_length)
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's limit of {limit}.")
    return config.max_model_len


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        logger.warning("ignoring unreadable %s", path)
        return {}
