"""Every check and default a request gets before it reaches the engine core, in one place: the prompt
(tokenized, non-empty, ids in the vocabulary, room left in the context), the sampling parameters
against the model (stop token ids, the default and the limit of max_tokens, generation_config's
defaults, truncate_prompt_tokens applied before the context checks), the request's seed, and its
structured output (exactly one kind, and a grammar that compiles; a `json` dict becomes JSON text);
and for an embedding request, its input (a text, or a cross-encoder's text pair) against what the model
embeds at most.
Raises `InvalidRequestError` naming the offending parameter. Runs on the caller's thread (the server
calls it from a worker pool): compiling a grammar without the vocabulary is cheap, but it grows with
the schema.
"""

from __future__ import annotations

import dataclasses
import random
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from PIL import Image

from llmserve.config import EngineConfig
from llmserve.engine.beam_search import BeamSearch
from llmserve.engine.grammar import validate_structured_outputs
from llmserve.engine.messages import EngineCoreRequest, KVTransferParams
from llmserve.engine.model_facts import ModelFacts, VisionFacts
from llmserve.errors import ContextLengthExceededError, InvalidRequestError
from llmserve.model.lora import AdapterChecker
from llmserve.model.lora_request import LoRARequest
from llmserve.model.pooling import ClassifierConfig, PoolingParams
from llmserve.multimodal.images import prepare
from llmserve.multimodal.inputs import (
    ImageInput,
    ImagePrompt,
    PreparedImage,
    expand_placeholders,
    image_prompt,
    placed_images,
)
from llmserve.sampling.params import SamplingParams
from llmserve.tokenizer.tokenizer import Tokenizer

_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# A bad word's earlier tokens are compared with the output's last ones every step.
MAX_BAD_WORD_TOKENS = 128
_EMBEDDING_SAMPLING = SamplingParams(max_tokens=1)  # what an embedding request carries: it samples nothing


MAX_IMAGES_PER_PROMPT = 16  # unless --limit-mm-per-prompt says; each image takes hundreds of tokens


class InputProcessor:
    def __init__(self, config: EngineConfig, facts: ModelFacts, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = facts.model_config.vocab_size
        self.eos_token_ids = facts.eos_token_ids
        self.max_model_len = facts.max_model_len
        self.model_name = config.served_model_name or config.model
        self.can_generate = facts.can_generate
        self.classifier = facts.classifier  # a sequence-classification model: it scores pairs and classifies
        self.can_embed = facts.pooler is not None and facts.classifier is None
        self.hidden_size = facts.model_config.hidden_size
        # An embedding's prompt is computed in one step: it must fit the step's token budget too.
        self.max_embedding_tokens = min(facts.max_model_len, config.max_num_batched_tokens)
        self._defaults = _generation_defaults(facts.generation_config)
        self._rng = random.Random(config.seed)
        self.kv_transfer = config.kv_transfer  # disaggregation: it takes kv_transfer_params
        self.adapters = AdapterChecker(facts.model_config, config.max_lora_rank) if config.lora_enabled else None
        self.vision = facts.vision  # a vision-language model's image facts
        self.max_images = (config.limit_mm_per_prompt or {}).get("image", MAX_IMAGES_PER_PROMPT)

    def check_lora(self, lora: LoRARequest) -> None:
        """Raises InvalidRequestError when the adapter cannot be served (read once, then known by its id)."""
        if self.adapters is None:
            raise InvalidRequestError(
                f"The model {self.model_name!r} serves no LoRA adapters: start it with --enable-lora.", param="model"
            )
        self.adapters.check(lora)

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's behaviour: the checkpoint's generation_config supplies default sampling settings."""
        return dataclasses.replace(self._defaults)

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt's token ids: text is encoded, ids are checked against the vocabulary."""
        if not len(prompt):  # checked before encoding: "" could still encode to a BOS token
            raise InvalidRequestError("The prompt is empty.", param="prompt")
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        token_ids = list(prompt)
        try:  # one C-level pass: anything but an int (or one beyond 64 bits) fails the conversion
            ids = array("q", token_ids)
        except (TypeError, OverflowError):
            ids = None
        if ids is None or min(ids) < 0 or max(ids) >= self.vocab_size:
            raise InvalidRequestError(f"Prompt token ids must be integers in [0, {self.vocab_size}).", param="prompt")
        return token_ids

    def bad_word_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """Each bad word's token sequences: as written and after a space, where the two differ (a word
        mid-sentence is usually one token with its space), without special tokens (vLLM's rule)."""
        texts = [text for word in words for text in (word.lstrip(), " " + word.lstrip())]
        sequences: dict[tuple[int, ...], None] = {}
        for text, ids in zip(texts, self.tokenizer.encode_pieces(texts), strict=True):
            if len(ids) > MAX_BAD_WORD_TOKENS:
                raise InvalidRequestError(
                    f"Each bad word may be at most {MAX_BAD_WORD_TOKENS} tokens long; {text.strip()[:40]!r}... "
                    f"is {len(ids)}.", param="bad_words",
                )
            if ids:
                sequences[tuple(ids)] = None
        return [list(ids) for ids in sequences]

    def truncate(self, token_ids: list[int], keep: int | None) -> list[int]:
        """The prompt's last `keep` tokens (truncate_prompt_tokens; -1: as many as the context holds)."""
        if keep is None:
            return token_ids
        keep = self.max_model_len if keep == -1 else keep
        if len(token_ids) <= keep:
            return token_ids
        if getattr(token_ids, "images", None):
            raise InvalidRequestError("truncate_prompt_tokens would cut a prompt with images.",
                                      param="truncate_prompt_tokens")
        return token_ids[-keep:]

    def max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The completion budget: `max_tokens`, or what the context window leaves when it is unset."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens, but the prompt has {num_prompt_tokens} "
                "tokens (at least one more is needed for the output).",
                param="prompt",
            )
        if params.max_tokens is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + params.max_tokens > limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + params.max_tokens} tokens ({num_prompt_tokens} in the prompt, "
                f"{params.max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens",
            )
        return params.max_tokens

    def process(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora: LoRARequest | None = None,
        kv_transfer: KVTransferParams | None = None,
    ) -> EngineCoreRequest:
        """The engine core's request, validated and with every default filled in."""
        if not self.can_generate:
            serves = ("scores (/v1/score, /v1/rerank) and labels (/classify)" if self.classifier is not None
                      else "embeddings (/v1/embeddings)")
            kind = "a sequence-classification model" if self.classifier is not None else "an encoder"
            raise InvalidRequestError(f"The model {self.model_name!r} is {kind}: it serves {serves}, not text "
                                      "generation.", param="model")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string.", param="cache_salt")
        params = params or self.default_sampling_params()
        if params.use_beam_search:  # a search over one-token requests, run by the front end (`beam_search`)
            raise InvalidRequestError("The engine core runs no beam search: start it with `beam_search`.",
                                      param="use_beam_search")
        token_ids = self.truncate(self.tokenize(prompt), params.truncate_prompt_tokens)
        images = self.check_images(prompt, token_ids)
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise InvalidRequestError(
                f"stop_token_ids must be below the vocabulary size {self.vocab_size}.", param="stop_token_ids"
            )
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise InvalidRequestError(
                f"logit_bias names token {max(params.logit_bias)}; token ids must be below the vocabulary size "
                f"{self.vocab_size}.", param="logit_bias",
            )
        if params.allowed_token_ids and max(params.allowed_token_ids) >= self.vocab_size:
            raise InvalidRequestError(
                f"allowed_token_ids names token {max(params.allowed_token_ids)}; token ids must be below the "
                f"vocabulary size {self.vocab_size}.", param="allowed_token_ids",
            )
        if params.bad_words:
            params = dataclasses.replace(params, bad_words_token_ids=self.bad_word_token_ids(params.bad_words))
        if params.prediction_token_ids is not None:
            self.check_prediction(params.prediction_token_ids)
        elif params.prediction:
            params = dataclasses.replace(params, prediction_token_ids=self.prediction_token_ids(params.prediction))
        params = validate_structured_outputs(params)
        max_tokens = self.max_tokens(len(token_ids), params)
        if max_tokens != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=max_tokens)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        if lora is not None:
            self.check_lora(lora)
        if kv_transfer is not None:
            self.check_kv_transfer(kv_transfer, params)
        return EngineCoreRequest(request_id, token_ids, params, seed, priority, cache_salt, lora=lora,
                                 kv_transfer=kv_transfer, images=images)

    def with_images(self, prompt: str | Sequence[int], images: Sequence[bytes | Image.Image],
                    param: str = "multi_modal_data", options: Mapping[str, Any] | None = None) -> ImagePrompt:
        """A prompt whose image placeholders (one per image, as a chat template writes them) stand for `images`
        (encoded bytes, or PIL images), prepared under the image processor `options` (`mm_processor_kwargs`).
        Runs on a worker thread: decoding and resizing grow with the images."""
        prepared = self.prepare_images(images, [f"{param}[{i}]" for i in range(len(images))], options)
        token_ids = self.tokenize(prompt)
        if token_ids.count(self.vision.image_token_id) != len(prepared):  # (prepared: the model reads images)
            raise InvalidRequestError(f"The prompt has places for {token_ids.count(self.vision.image_token_id)} "
                                      f"images but {len(prepared)} were sent.", param=param)
        return self.place_images(self.expand_placeholders(token_ids, prepared), prepared)

    def prepare_images(self, images: Sequence[bytes | Image.Image], params: Sequence[str],
                       options: Mapping[str, Any] | None = None) -> list[PreparedImage]:
        """Images decoded and prepared as the model reads them, under the image processor `options`
        (`vision_options`); a 400 naming the parameter of one that is not an image, and for a model that reads
        none."""
        if self.vision is None:
            raise InvalidRequestError(f"The model {self.model_name!r} reads text only, not images.", param=params[0])
        if len(images) > self.max_images:
            raise InvalidRequestError(f"A prompt holds at most {self.max_images} images here (--limit-mm-per-prompt), "
                                      f"not {len(images)}.", param=params[self.max_images])
        vision = self.vision_options(options)
        return [prepare(vision.processor, image, param, vision.num_tokens, vision.span)
                for image, param in zip(images, params, strict=True)]

    def vision_options(self, options: Mapping[str, Any] | None, param: str = "mm_processor_kwargs") -> VisionFacts:
        """The model's image facts under a request's image processor options (vLLM's `mm_processor_kwargs`); a 400
        naming an option the model's processor does not take, or any for a model that reads no images."""
        if self.vision is None:
            raise InvalidRequestError(f"The model {self.model_name!r} reads text only: it has no image processor.",
                                      param=param)
        return self.vision.with_options(options or {}, param)

    def expand_placeholders(self, token_ids: list[int], images: Sequence[PreparedImage]) -> list[int]:
        """Each image placeholder a template wrote as the tokens its image takes: the last of `images`, as many as
        there are placeholders (fitting a conversation to the context drops its earliest turns)."""
        if self.vision is None or not images:
            return token_ids
        placeholder = self.vision.image_token_id
        places = token_ids.count(placeholder)
        kept = images[max(0, len(images) - places):]
        return expand_placeholders(token_ids, placeholder, [image.num_tokens for image in kept])

    def place_images(self, token_ids: list[int], images: Sequence[PreparedImage]) -> ImagePrompt:
        """Expanded token ids with the last of `images` (as many as they hold) at their placeholder runs, in order."""
        assert self.vision is not None
        placeholder = self.vision.image_token_id
        return image_prompt(token_ids, placed_images(token_ids, images, placeholder), placeholder)

    def check_images(self, prompt: str | Sequence[int], token_ids: list[int]) -> list[ImageInput]:
        """The prompt's images (an `ImagePrompt`'s), each over a whole run of the model's placeholder tokens; a
        placeholder no image stands behind is a 400, as are images for a model that reads none."""
        images: list[ImageInput] = getattr(prompt, "images", [])
        if self.vision is None:
            if images:
                raise InvalidRequestError(f"The model {self.model_name!r} reads text only, not images.",
                                          param="messages")
            return []
        placeholder = self.vision.image_token_id
        count = token_ids.count(placeholder)
        if images and len(token_ids) != len(prompt):
            raise InvalidRequestError("truncate_prompt_tokens would cut a prompt with images.",
                                      param="truncate_prompt_tokens")
        if count != sum(image.length for image in images) or any(
                token_ids[image.offset] != placeholder or token_ids[image.offset + image.length - 1] != placeholder
                for image in images):
            raise InvalidRequestError(
                f"The prompt has {count} image placeholder tokens (id {placeholder}) for {len(images)} images "
                f"({sum(image.length for image in images)} tokens): images go in content parts, not in text or token "
                "ids.", param="prompt")
        return images

    def beam_search(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, priority: int = 0,
        cache_salt: str | None = None, lora: LoRARequest | None = None, kv_transfer: KVTransferParams | None = None,
    ) -> BeamSearch:
        """A beam-search request's search, its prompt and limits checked as a request's are."""
        if getattr(prompt, "images", None):
            raise InvalidRequestError("use_beam_search does not take images.", param="use_beam_search")
        if kv_transfer is not None:
            raise InvalidRequestError("use_beam_search does not take kv_transfer_params: its beams are many "
                                      "requests, not one whose KV could be handed over.", param="kv_transfer_params")
        checked = self.process(request_id, prompt, dataclasses.replace(params, use_beam_search=False), priority,
                               cache_salt, lora)
        # A beam's requests are one token each: nothing to draft, so a prediction is left out of them.
        beams = dataclasses.replace(params, max_tokens=checked.params.max_tokens, prediction=None,
                                    prediction_token_ids=None)
        return BeamSearch(request_id, prompt if isinstance(prompt, str) else None, checked.prompt_token_ids, beams,
                          self.eos_token_ids)

    def check_kv_transfer(self, transfer: KVTransferParams, params: SamplingParams) -> None:
        """A request's disaggregation part is one this engine can do."""
        def bad(message: str) -> InvalidRequestError:
            return InvalidRequestError(message, param="kv_transfer_params")

        if not self.kv_transfer:
            raise bad("This server transfers no KV between replicas (start it with --kv-transfer).")
        if transfer.do_remote_decode == transfer.do_remote_prefill:
            raise bad("kv_transfer_params must ask for exactly one of do_remote_decode and do_remote_prefill.")
        if transfer.do_remote_decode and params.n != 1:
            raise bad("A request whose KV is kept for another replica (do_remote_decode) must have n = 1.")
        if transfer.do_remote_prefill:
            missing = [name for name in ("transfer_id", "remote_host", "remote_port") if not getattr(transfer, name)]
            if missing:
                raise bad(f"do_remote_prefill needs {', '.join(missing)}.")


    def check_can_embed(self) -> None:
        if self.classifier is not None:
            raise InvalidRequestError(
                f"The model {self.model_name!r} is a sequence-classification model: it scores text pairs "
                "(/v1/score, /v1/rerank) and classifies texts (/classify), but does not embed.", param="model",
            )
        if not self.can_embed:
            raise InvalidRequestError(
                f"The model {self.model_name!r} does not serve embeddings; start it with --task embed to "
                "pool its hidden states.", param="model",
            )

    def prediction_token_ids(self, prediction: str) -> list[int]:
        """A predicted output's tokens, as the output would hold them (no special tokens added); a server calls
        this on a worker thread and gives the engine the ids."""
        ids = self.tokenizer.encode(prediction, add_special_tokens=False)
        self.check_prediction(ids)
        return ids

    def check_prediction(self, token_ids: Sequence[int]) -> None:
        if len(token_ids) > self.max_model_len:
            raise InvalidRequestError(f"The prediction is {len(token_ids)} tokens, more than the context window of "
                                      f"{self.max_model_len} could ever generate.", param="prediction")
        try:  # one C-level pass, as a prompt's ids are checked
            ids = array("q", token_ids)
        except (TypeError, OverflowError):
            ids = None
        if ids is None or (len(ids) and (min(ids) < 0 or max(ids) >= self.vocab_size)):
            raise InvalidRequestError(f"Prediction token ids must be integers in [0, {self.vocab_size}).",
                                      param="prediction")

    def check_can_classify(self) -> ClassifierConfig:
        """The model's labels; a 400 naming `model` when it has none."""
        if self.classifier is None:
            raise InvalidRequestError(
                f"The model {self.model_name!r} is not a sequence-classification model: it has no labels.",
                param="model",
            )
        return self.classifier

    def embedding_tokens(self, prompt: str | Sequence[int], truncate_prompt_tokens: int | None = None) -> list[int]:
        """An embedding input's tokens: cut from the right to `truncate_prompt_tokens` (-1: to what the
        model embeds at most; text keeps its special tokens, as sentence-transformers truncates) and
        checked against what the model embeds at most."""
        keep = self._kept_tokens(truncate_prompt_tokens)
        if not len(prompt):
            raise InvalidRequestError("The input is empty.", param="input")
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt) if keep is None else self.tokenizer.encode_truncated(prompt, keep)
        else:
            try:
                token_ids = self.tokenize(prompt)[:keep]
            except InvalidRequestError as exc:
                exc.param = "input"
                raise
        self._check_embedded_length(token_ids, "the input")
        return token_ids

    def pair_tokens(
        self, first: str, second: str, truncate_prompt_tokens: int | None = None
    ) -> tuple[list[int], int | None]:
        """A cross-encoder's input: the pair joined as its tokenizer joins two texts, and where the second
        text's token type starts (`Tokenizer.encode_pair`); cut to `truncate_prompt_tokens` longest text first
        (as sentence-transformers' CrossEncoder truncates), and checked as `embedding_tokens` checks."""
        keep = self._kept_tokens(truncate_prompt_tokens)
        least = self.tokenizer.pair_special_tokens + 2
        if keep is not None and keep < least:
            raise InvalidRequestError(
                f"truncate_prompt_tokens {keep} leaves no room for a text pair: it needs at least {least} tokens "
                "(the special tokens joining the pair, and one token of each text).", param="truncate_prompt_tokens",
            )
        token_ids, second_start = self.tokenizer.encode_pair(first, second, keep)
        self._check_embedded_length(token_ids, "the text pair")
        return token_ids, second_start

    def _kept_tokens(self, truncate_prompt_tokens: int | None) -> int | None:
        """How many tokens an input keeps at most (None: all; then it must fit)."""
        limit = self.max_embedding_tokens
        keep = truncate_prompt_tokens
        if keep is None:
            return None
        if isinstance(keep, bool) or not isinstance(keep, int) or keep == 0 or keep < -1 or keep > limit:
            raise InvalidRequestError(
                f"truncate_prompt_tokens must be -1 or in [1, {limit}] for this model, got {keep!r}.",
                param="truncate_prompt_tokens",
            )
        return limit if keep == -1 else keep

    def _check_embedded_length(self, token_ids: list[int], what: str) -> None:
        limit = self.max_embedding_tokens
        if len(token_ids) > limit:
            raise ContextLengthExceededError(
                f"This model embeds at most {limit} tokens, but {what} has {len(token_ids)} tokens. Please "
                "shorten it, or set truncate_prompt_tokens to cut it.",
                param="input",
            )

    def process_embedding(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        pooling: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        priority: int = 0,
    ) -> EngineCoreRequest:
        """The engine core's embedding request, its input checked (see `embedding_tokens`); a classifier's
        gives its label logits."""
        if self.classifier is None:
            self.check_can_embed()
        pooling = pooling or PoolingParams()
        pooling.validate(self.hidden_size)
        token_ids = self.embedding_tokens(prompt, truncate_prompt_tokens)
        return EngineCoreRequest(request_id, token_ids, _EMBEDDING_SAMPLING, 0, priority, pooling=pooling)


def _generation_defaults(generation_config: dict) -> SamplingParams:
    gen = generation_config
    do_sample = gen.get("do_sample", True)
    overrides = {k: gen[k] for k in _GENERATION_DEFAULTS if k in gen and (do_sample or k == "repetition_penalty")}
    return SamplingParams(**overrides)
