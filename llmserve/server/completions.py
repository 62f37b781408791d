"""POST /v1/completions (the legacy text API): the prompt(s) tokenized, run by the request pipeline in
the completions shape. A list of prompts fans out into one engine request per prompt; choice j of
prompt i gets index i*n+j, as OpenAI numbers them."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.platform.content_routing import prompt_texts
from llmserve.server import errors
from llmserve.server.gateway import request_key
from llmserve.server.logprobs import (
    TokenTexts,
    completion_logprobs,
    echoed_completion_logprobs,
    logprob_texts,
    vllm_prompt_logprobs,
)
from llmserve.server.openapi import documented
from llmserve.server.pipeline import Choice, ChoiceRenderer, PreparedRequest, ResponseShape, respond
from llmserve.server.protocol import CompletionChoice, CompletionRequest, CompletionResponse, Usage
from llmserve.server.sampling import constraint_field, engine_kv_transfer, to_sampling_params
from llmserve.server.state import ModelEndpoint, get_state
from llmserve.server.streaming import Delta, text_choice_json

router = APIRouter()


@router.post("/v1/completions", response_model=None, responses=documented(CompletionResponse, stream=True))
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = get_state(request)
    key = request_key(request.state)
    prompts = body.prompts()
    endpoint = await state.routed_endpoint(body.model, key, key.id if key is not None else body.user,
                                           lambda: prompt_texts(prompts))
    errors.reject_unsupported(body.unsupported_params())
    params = to_sampling_params(
        body, endpoint.engine.default_sampling_params(), body.max_tokens, logprobs=body.logprobs
    )
    for prompt in prompts:
        if isinstance(prompt, str):
            endpoint.prompt_bound.check(len(prompt))
    prompt_ids = await state.workers.run(_tokenize, endpoint, prompts, body.truncate_prompt_tokens)
    prepared = PreparedRequest(
        state=state,
        endpoint=endpoint,
        key=key,
        prompts=prompt_ids,
        params=params,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        continuous_usage=bool(body.stream_options and body.stream_options.continuous_usage_stats),
        obfuscate=bool(body.stream_options and body.stream_options.include_obfuscation),
        resumable=bool(body.stream_options and body.stream_options.resumable),
        screen_texts=lambda: [_prompt_text(p, endpoint.token_texts) for p in prompts],
        screen_param="prompt",
        priority=body.priority,
        cache_salt=body.cache_salt,
        kv_transfer=engine_kv_transfer(body.kv_transfer_params),
        renames={"structured_outputs": field} if (field := constraint_field(body)) is not None else None,
        return_token_ids=body.return_token_ids,
    )
    echo_texts = [_prompt_text(p, endpoint.token_texts) if body.echo else "" for p in prompts]
    shape = CompletionShape(
        body.logprobs, echo_texts, logprob_texts(endpoint.token_texts, body.return_tokens_as_token_ids),
        body.echoes_logprobs, body.prompt_logprobs, token_ids=body.return_token_ids,
    )
    return await respond(request, prepared, shape)


def _tokenize(
    endpoint: ModelEndpoint, prompts: Sequence[str | list[int]], keep: int | None
) -> list[list[int]]:
    """Text prompts encoded, id prompts checked against the vocabulary (before anything decodes them),
    truncated to `truncate_prompt_tokens`."""
    processor = endpoint.engine.input_processor
    return [processor.truncate(processor.tokenize(p), keep) for p in prompts]


def _prompt_text(prompt: str | list[int], texts: TokenTexts) -> str:
    return prompt if isinstance(prompt, str) else texts.decode(prompt)


# ---- the completions shape ------------------------------------------------------------------------


class CompletionChoiceRenderer(ChoiceRenderer):
    """A completion choice: its text after its prompt's echo, and the text offset its logprobs report next."""

    def __init__(
        self, index: int, logprobs: int | None, texts: TokenTexts, echo: str, echo_logprobs: bool,
        prompt_logprobs: int | None, token_ids: bool = False,
    ) -> None:
        self.index = index
        self.token_ids = token_ids  # vLLM's return_token_ids
        self.logprobs = logprobs  # None: no logprobs
        self.texts = texts
        self.echo = echo
        self.echo_logprobs = echo_logprobs  # the prompt's tokens lead the choice's logprobs
        self.prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs field, with this many top logprobs
        self.offset = len(echo)  # text_offset of the next token (after an echoed prompt)
        self.first = True  # no chunk sent yet

    def chunk_choice(self, delta: Delta, output: RequestOutput) -> Choice:
        first, self.first = self.first, False
        if first and (self.echo_logprobs or self.prompt_logprobs is not None):
            choice = self._first_with_prompt_logprobs(delta, output)
        elif self.logprobs is None or delta.logprobs is None:
            if not self.token_ids:
                return text_choice_json(self.index, delta.text, delta.finish_reason)
            choice = CompletionChoice(index=self.index, text=delta.text, finish_reason=delta.finish_reason)
        else:
            logprobs = completion_logprobs(delta.token_ids, delta.logprobs, self.logprobs, self.texts, self.offset)
            self.offset += sum(len(t) for t in logprobs.tokens)
            choice = CompletionChoice(index=self.index, text=delta.text, logprobs=logprobs,
                                      finish_reason=delta.finish_reason)
        if self.token_ids:
            choice.token_ids = list(delta.token_ids)
            if first:
                choice.prompt_token_ids = list(output.prompt_token_ids)
        return choice

    def _first_with_prompt_logprobs(self, delta: Delta, output: RequestOutput) -> CompletionChoice:
        """The first chunk, which the prompt's logprobs come with (the engine scores the whole prompt
        before the first token): echoed, the prompt's text and tokens lead it; vLLM's prompt_logprobs."""
        text, logprobs = delta.text, None
        if self.echo_logprobs and delta.logprobs is not None:
            text = self.echo + delta.text
            logprobs = echoed_completion_logprobs(output, delta.token_ids, delta.logprobs, self.logprobs or 0, self.texts)
            self.offset = sum(len(t) for t in logprobs.tokens)
        elif self.logprobs is not None and delta.logprobs is not None:
            logprobs = completion_logprobs(delta.token_ids, delta.logprobs, self.logprobs, self.texts, self.offset)
            self.offset += sum(len(t) for t in logprobs.tokens)
        return CompletionChoice(
            index=self.index,
            text=text,
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            prompt_logprobs=vllm_prompt_logprobs(output.prompt_logprobs, self.prompt_logprobs),
        )

    def response_choice(
        self, completion: CompletionOutput, text: str, finish_reason: str | None, output: RequestOutput
    ) -> CompletionChoice:
        logprobs = None
        if self.logprobs is not None and completion.logprobs is not None:
            logprobs = (
                echoed_completion_logprobs(output, completion.token_ids, completion.logprobs, self.logprobs, self.texts)
                if self.echo_logprobs
                else completion_logprobs(
                    completion.token_ids, completion.logprobs, self.logprobs, self.texts, len(self.echo)
                )
            )
        return CompletionChoice(
            index=self.index,
            text=self.echo + text,
            logprobs=logprobs,
            finish_reason=finish_reason,
            prompt_logprobs=vllm_prompt_logprobs(output.prompt_logprobs, self.prompt_logprobs),
            prompt_token_ids=list(output.prompt_token_ids) if self.token_ids else None,
            token_ids=list(completion.token_ids) if self.token_ids else None,
        )


class CompletionShape(ResponseShape):
    """text_completion bodies; each prompt's echoed text (if any) goes first."""

    id_prefix = "cmpl"

    def __init__(
        self, logprobs: int | None, echo_texts: list[str], texts: TokenTexts, echo_logprobs: bool,
        prompt_logprobs: int | None, token_ids: bool = False,
    ) -> None:
        self.token_ids = token_ids
        self.logprobs = logprobs
        self.echo_texts = echo_texts  # per prompt: the text echoed before its choices ("" without echo)
        self.texts = texts
        self.echo_logprobs = echo_logprobs
        self.prompt_logprobs = prompt_logprobs

    def renderer(self, position: int, index: int) -> CompletionChoiceRenderer:
        return CompletionChoiceRenderer(
            index, self.logprobs, self.texts, self.echo_texts[position], self.echo_logprobs, self.prompt_logprobs,
            token_ids=self.token_ids,
        )

    def empty_chunk(self, response_id: str, created: int, model: str, usage: Usage | None) -> CompletionResponse:
        return CompletionResponse(id=response_id, created=created, model=model, choices=[], usage=usage)

    def response(
        self, response_id: str, model: str, choices: list[BaseModel], usage: Usage, outputs: Sequence[RequestOutput]
    ) -> CompletionResponse:
        return CompletionResponse(id=response_id, model=model, choices=choices, usage=usage,
                                  kv_transfer_params=outputs[0].kv_transfer_params)

    def opening_chunks(self, prompts: int, n: int) -> list[list[Choice]]:
        if self.echo_logprobs:
            return []  # the echo comes with its logprobs, in each choice's first chunk
        return [
            [CompletionChoice(index=position * n + j, text=text, finish_reason=None) for j in range(n)]
            for position, text in enumerate(self.echo_texts)
            if text
        ]
