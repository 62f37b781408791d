"""The offline API in vLLM's shape: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from collections.abc import Sequence as Seq

import numpy as np

from llmserve.config import EngineConfig
from llmserve.engine.beam_search import BeamSearch
from llmserve.engine.llm_engine import LLMEngine
from llmserve.errors import InvalidRequestError
from llmserve.model.lora_request import LoRARequest
from llmserve.model.pooling import PoolingParams, cosine_scores, relevance_scores
from llmserve.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from llmserve.sampling.params import RequestOutputKind, SamplingParams
from llmserve.tokenizer.tokenizer import read_chat_template

# vLLM's prompt shapes: text, token ids, {"prompt": text} (TextPrompt), {"prompt_token_ids": ids}
# (TokensPrompt); either dict may carry a "cache_salt".
Prompt = str | Seq[int] | Mapping[str, object]
Message = dict[str, object]
_PROMPT_KEYS = {"prompt", "prompt_token_ids"}
_OPTIONAL_PROMPT_KEYS = {"cache_salt", "multi_modal_data", "mm_processor_kwargs"}


class LLM:
    """Runs a batch of prompts to completion with continuous batching.

    `model` is a local checkpoint directory or a Hugging Face hub id; None uses the built-in model
    (created on first use). Other keyword arguments are `EngineConfig` fields.
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        if model is None:
            from llmserve.model.builtin import DEFAULT_ARCH, DEFAULT_SIZE, ensure_default_model

            model = str(ensure_default_model(DEFAULT_ARCH, DEFAULT_SIZE))
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        priority: Seq[int] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """`lora_request`: the LoRA adapter every prompt (or each, one per prompt) generates with (vLLM's;
        needs `enable_lora=True`)."""
        batch = _as_prompt_list(prompts)
        params = _broadcast(sampling_params, len(batch), self.engine.default_sampling_params)
        priorities = list(priority) if priority is not None else [0] * len(batch)
        adapters = list(lora_request) if isinstance(lora_request, Seq) else [lora_request] * len(batch)
        if len(adapters) != len(batch):
            raise InvalidRequestError(f"{len(adapters)} lora_requests for {len(batch)} prompts.", param="lora_request")
        requests = list(zip(batch, params, priorities, adapters, strict=True))
        sampled = [i for i, (_, p, _, _) in enumerate(requests) if not p.use_beam_search]
        searched = [i for i, (_, p, _, _) in enumerate(requests) if p.use_beam_search]
        searches = [self._new_search(*requests[i]) for i in searched]  # checked before anything runs
        request_ids = []
        try:
            for prompt, p, prio, lora in (requests[i] for i in sampled):
                request_id = f"offline-{next(self._ids)}"
                final_only = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)  # nothing reads the rest
                content, cache_salt = self._prompt_content(prompt)
                self.engine.add_request(request_id, content, final_only, priority=prio, cache_salt=cache_salt,
                                        lora_request=lora)
                request_ids.append(request_id)
        except Exception:
            self.engine.abort_request(request_ids)
            raise
        outputs = dict(zip(sampled, self._run(request_ids), strict=True))
        outputs.update(zip(searched, self._run_searches(searches), strict=True))
        return [outputs[i] for i in range(len(requests))]  # type: ignore[misc]

    def _prompt_content(self, prompt: Prompt) -> tuple[str | Seq[int], str | None]:
        """A prompt's text or token ids (with its images, when it has `multi_modal_data`, prepared under its
        `mm_processor_kwargs`), and its cache salt."""
        content, cache_salt = _unpack_prompt(prompt)
        images = _images(prompt)
        options = prompt.get("mm_processor_kwargs") if isinstance(prompt, Mapping) else None
        if options is not None and not isinstance(options, Mapping):
            raise InvalidRequestError("mm_processor_kwargs takes an object of the image processor's options.",
                                      param="mm_processor_kwargs")
        if not images:
            if options is not None:
                self.engine.input_processor.vision_options(options)
            return content, cache_salt
        return self.engine.input_processor.with_images(content, images, options=options), cache_salt

    def _new_search(
        self, prompt: Prompt, params: SamplingParams, priority: int, lora: LoRARequest | None
    ) -> tuple[BeamSearch, dict[str, object]]:
        """A request's beam search, and the options its step requests are added with."""
        content, cache_salt = self._prompt_content(prompt)
        search = self.engine.input_processor.beam_search(f"offline-{next(self._ids)}", content, params, priority,
                                                         cache_salt, lora)
        return search, {"priority": priority, "cache_salt": cache_salt, "lora_request": lora}

    def _run_searches(self, searches: list[tuple[BeamSearch, dict[str, object]]]) -> list[RequestOutput]:
        """The beam searches stepped together: each step's one-token requests run as one batch
        (`llmserve.engine.beam_search`)."""
        while True:
            step_ids: list[list[str]] = []
            try:
                for search, option in searches:
                    step_ids.append([])
                    for prompt_ids in search.pending():
                        step_ids[-1].append(request_id := f"offline-{next(self._ids)}")
                        self.engine.add_request(request_id, prompt_ids, search.step_params, **option)
            except Exception:
                self.engine.abort_request([r for ids in step_ids for r in ids])
                raise
            if not any(step_ids):
                break
            results = iter(self._run([r for ids in step_ids for r in ids]))
            for (search, _), ids in zip(searches, step_ids, strict=True):
                if ids:
                    search.advance([next(results) for _ in ids])  # type: ignore[misc]
        processor = self.engine.output_processor
        return [search.output(processor.tokenizer, processor.token_text) for search, _ in searches]

    def chat(
        self,
        messages: Seq[Message] | Seq[Seq[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
        tools: Seq[Mapping[str, object]] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations; `continue_final_message` (with `add_generation_prompt`
        False) has the model go on with each conversation's final message instead. `lora_request` as
        `generate`'s. As vLLM's: `chat_template` (a template, or a file holding one) in place of the model's,
        `chat_template_kwargs` the template's further variables, `tools` OpenAI tool dicts it renders."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        template = read_chat_template(chat_template) if chat_template is not None else None
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.engine.tokenizer
        prompts = [
            tokenizer.apply_chat_template(list(c), add_generation_prompt=add_generation_prompt, tokenize=True,
                                          continue_final_message=continue_final_message, chat_template=template,
                                          tools=tools, **(chat_template_kwargs or {}))
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, lora_request=lora_request)

    def embed(
        self,
        prompts: Prompt | Seq[Prompt],
        pooling_params: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`output.outputs.embedding`), batched by the engine's scheduler.
        `truncate_prompt_tokens` cuts each input from the right (-1: to what the model embeds at most)."""
        self.engine.input_processor.check_can_embed()
        return self._pool([(_unpack_prompt(p)[0], None) for p in _as_prompt_list(prompts)], truncate_prompt_tokens,
                          pooling_params)

    def classify(self, prompts: Prompt | Seq[Prompt], truncate_prompt_tokens: int | None = None
                 ) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities by a sequence-classification model (softmax over its labels; each
        label's sigmoid for a multi-label classifier)."""
        classifier = self.engine.input_processor.check_can_classify()
        outputs = self._pool([(_unpack_prompt(p)[0], None) for p in _as_prompt_list(prompts)], truncate_prompt_tokens)
        return [ClassificationRequestOutput(o.request_id, o.prompt_token_ids,
                                            ClassificationOutput(classifier.probabilities(o.outputs.data).tolist()))
                for o in outputs]

    def score(self, text_1: str | Seq[str], text_2: str | Seq[str], truncate_prompt_tokens: int | None = None
              ) -> list[ScoringRequestOutput]:
        """How related `text_1` (one text, or one per text of `text_2`) is to each of `text_2`: a cross-encoder's
        score of the pair (its logit through its activation), or the cosine of an embedding model's embeddings."""
        seconds = [text_2] if isinstance(text_2, str) else list(text_2)
        firsts = [text_1] if isinstance(text_1, str) else list(text_1)
        if len(firsts) == 1:
            firsts *= len(seconds)
        if len(firsts) != len(seconds):
            raise ValueError(f"text_1 holds {len(firsts)} texts: it must hold one, or as many as text_2.")
        processor = self.engine.input_processor
        classifier = processor.classifier
        if classifier is None:  # each text embedded once
            processor.check_can_embed()
            texts = list(dict.fromkeys([*firsts, *seconds]))
            at = {text: i for i, text in enumerate(texts)}
            pairs = [(at[a], at[b]) for a, b in zip(firsts, seconds, strict=True)]
            outputs = self._pool([(text, None) for text in texts], truncate_prompt_tokens)
            scores = cosine_scores(np.stack([o.outputs.data for o in outputs]), pairs)
            tokens = [outputs[a].prompt_token_ids + outputs[b].prompt_token_ids for a, b in pairs]
            ids = [f"offline-{next(self._ids)}" for _ in pairs]
        else:
            if len(classifier.labels) != 1:
                raise InvalidRequestError(f"This model classifies into {len(classifier.labels)} labels; a score "
                                          "needs a cross-encoder with one.", param="model")
            outputs = self._pool(list(zip(firsts, seconds, strict=True)), truncate_prompt_tokens)
            scores = relevance_scores(np.array([o.outputs.data[0] for o in outputs]), classifier.score_activation)
            tokens = [o.prompt_token_ids for o in outputs]
            ids = [o.request_id for o in outputs]
        return [ScoringRequestOutput(i, t, ScoringOutput(s)) for i, t, s in zip(ids, tokens, scores, strict=True)]

    def _pool(self, inputs: list[tuple[str | Seq[int], str | None]], truncate_prompt_tokens: int | None,
              pooling: PoolingParams | None = None) -> list[EmbeddingRequestOutput]:
        """One pooled engine request per input: a prompt (second None), or a text pair for a cross-encoder."""
        processor = self.engine.input_processor
        request_ids = []
        try:
            for first, second in inputs:
                request_id = f"offline-{next(self._ids)}"
                if second is None:
                    self.engine.add_embedding_request(request_id, first, pooling, truncate_prompt_tokens)
                else:
                    ids, start = processor.pair_tokens(first, second, truncate_prompt_tokens)  # type: ignore[arg-type]
                    self.engine.add_embedding_request(request_id, ids, PoolingParams(second_text_start=start))
                request_ids.append(request_id)
        except Exception:
            self.engine.abort_request(request_ids)
            raise
        return self._run(request_ids)  # type: ignore[return-value]

    def _run(self, request_ids: list[str]) -> list[RequestOutput | EmbeddingRequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput | EmbeddingRequestOutput] = {}
        while pending:
            for output in self.engine.step():
                if output.finished and output.request_id in pending:
                    finished[output.request_id] = output
                    pending.discard(output.request_id)
        return [finished[r] for r in request_ids]


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # a single prompt given as token ids
    return items


def _images(prompt: Prompt) -> list:
    """A prompt dict's `multi_modal_data` images (vLLM's: {"image": an image or a list of them}, PIL images or
    their encoded bytes)."""
    data = prompt.get("multi_modal_data") if isinstance(prompt, Mapping) else None
    if data is None:
        return []
    if not isinstance(data, Mapping) or set(data) != {"image"}:
        raise InvalidRequestError('multi_modal_data takes {"image": an image or a list of images}.',
                                  param="multi_modal_data")
    images = data["image"]
    return list(images) if isinstance(images, list | tuple) else [images]


def _unpack_prompt(prompt: Prompt) -> tuple[str | Seq[int], str | None]:
    """A prompt's text or token ids, and its cache salt; a dict must name exactly one of them."""
    if not isinstance(prompt, Mapping):
        return prompt, None
    unknown = set(prompt) - _PROMPT_KEYS - _OPTIONAL_PROMPT_KEYS
    if unknown:
        raise InvalidRequestError(f"Unsupported prompt keys: {', '.join(sorted(unknown))}.", param="prompt")
    given = _PROMPT_KEYS & set(prompt)
    if len(given) != 1:
        raise InvalidRequestError('A prompt dict needs exactly one of "prompt" and "prompt_token_ids".',
                                  param="prompt")
    salt = prompt.get("cache_salt")
    if "prompt" in prompt:
        text = prompt["prompt"]
        if not isinstance(text, str):
            raise InvalidRequestError('"prompt" must be a string.', param="prompt")
        return text, salt  # type: ignore[return-value]
    ids = prompt["prompt_token_ids"]
    if isinstance(ids, str) or not isinstance(ids, Seq):
        raise InvalidRequestError('"prompt_token_ids" must be a list of token ids.', param="prompt_token_ids")
    return ids, salt  # type: ignore[return-value]


def _broadcast(params, count: int, default) -> list[SamplingParams]:
    if params is None:
        return [default() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"Got {len(params)} sampling params for {count} prompts.")
    return params
