"""POST /v1/completions (the legacy text API), streamed and not.

A list of prompts fans out into one engine request per prompt; choice j of prompt i gets index i*n+j,
as OpenAI numbers them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from llmserve.engine.async_llm import RequestStream
from llmserve.errors import LLMServeError
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.server import errors
from llmserve.server.logprobs import TokenTexts, completion_logprobs
from llmserve.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
    now,
)
from llmserve.server.sampling import to_sampling_params
from llmserve.server.state import get_state
from llmserve.server.streaming import (
    SSE_DONE,
    StreamCursor,
    event_stream,
    final_outputs,
    merged,
    sse,
    until_disconnect,
)
from llmserve.server.submit import start_requests

router = APIRouter()


@dataclass
class _CompletionContext:
    response_id: str
    model: str
    n: int
    logprobs: int | None
    echo_texts: list[str]  # per prompt: the text echoed before its choices ("" without echo)
    include_usage: bool
    texts: TokenTexts


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = get_state(request)
    state.check_model(body.model)
    errors.reject_unsupported(body.unsupported_params())
    params = to_sampling_params(
        body, state.engine.default_sampling_params(), body.max_tokens, logprobs=body.logprobs
    )
    prompts = body.prompts()
    response_id, streams = await start_requests(
        state, "cmpl", prompts, params, body.priority, cache_salt=body.cache_salt
    )
    ctx = _CompletionContext(
        response_id=response_id,
        model=body.model or state.served_model_name,
        n=body.n,
        logprobs=body.logprobs,
        echo_texts=[_prompt_text(p, state.token_texts) if body.echo else "" for p in prompts],
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        texts=state.token_texts,
    )
    if body.stream:
        return event_stream(_completion_events(streams, ctx))
    outputs = await until_disconnect(request, final_outputs(streams))
    return JSONResponse(_completion_response(outputs, ctx).model_dump())


def _prompt_text(prompt: str | list[int], texts: TokenTexts) -> str:
    return prompt if isinstance(prompt, str) else texts.decode(prompt)


def _usage(outputs: Sequence[RequestOutput]) -> Usage:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return Usage.of(prompt_tokens, completion_tokens, sum(o.num_cached_tokens for o in outputs))


# ---- non-streamed ---------------------------------------------------------------------------------


def _choice(
    position: int, output: RequestOutput, completion: CompletionOutput, ctx: _CompletionContext
) -> CompletionChoice:
    prefix = ctx.echo_texts[position]
    logprobs = None
    if ctx.logprobs is not None and completion.logprobs is not None:
        logprobs = completion_logprobs(
            completion.token_ids, completion.logprobs, ctx.logprobs, ctx.texts, len(prefix)
        )
    return CompletionChoice(
        index=position * ctx.n + completion.index,
        text=prefix + completion.text,
        logprobs=logprobs,
        finish_reason=completion.finish_reason,
    )


def _completion_response(outputs: Sequence[RequestOutput], ctx: _CompletionContext) -> CompletionResponse:
    choices = [_choice(i, o, c, ctx) for i, o in enumerate(outputs) for c in o.outputs]
    return CompletionResponse(id=ctx.response_id, model=ctx.model, choices=choices, usage=_usage(outputs))


# ---- streamed -------------------------------------------------------------------------------------


class _ChoiceCursor(StreamCursor):
    """A completion choice's stream position, plus the text offset its logprobs report next."""

    def __init__(self, index: int, text_offset: int) -> None:
        super().__init__()
        self.index = index
        self.offset = text_offset  # text_offset of the next token (after an echoed prompt)

    def next_choice(self, completion: CompletionOutput, ctx: _CompletionContext) -> CompletionChoice | None:
        delta = self.advance(completion)
        if delta is None:
            return None
        logprobs = None
        if ctx.logprobs is not None and delta.logprobs is not None:
            logprobs = completion_logprobs(delta.token_ids, delta.logprobs, ctx.logprobs, ctx.texts, self.offset)
            self.offset += sum(len(t) for t in logprobs.tokens)
        return CompletionChoice(index=self.index, text=delta.text, logprobs=logprobs, finish_reason=delta.finish_reason)


async def _completion_events(streams: list[RequestStream], ctx: _CompletionContext) -> AsyncIterator[str]:
    created = now()

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return sse(
            CompletionResponse(
                id=ctx.response_id, created=created, model=ctx.model, choices=choices, usage=usage
            )
        )

    cursors: dict[int, _ChoiceCursor] = {}
    finals: dict[int, RequestOutput] = {}
    try:
        for position, text in enumerate(ctx.echo_texts):
            if text:
                yield chunk(
                    [
                        CompletionChoice(index=position * ctx.n + j, text=text, finish_reason=None)
                        for j in range(ctx.n)
                    ]
                )
        async for position, output in merged(streams):
            choices = []
            for completion in output.outputs:
                index = position * ctx.n + completion.index
                cursor = cursors.setdefault(index, _ChoiceCursor(index, len(ctx.echo_texts[position])))
                choice = cursor.next_choice(completion, ctx)
                if choice is not None:
                    choices.append(choice)
            if output.finished:
                finals[position] = output
            if choices:
                yield chunk(choices)
        if ctx.include_usage:
            yield chunk([], _usage([finals[i] for i in sorted(finals)]))
        yield SSE_DONE
    except LLMServeError as exc:  # the engine died or is shutting down mid-stream
        yield sse(errors.from_exception(exc).body_json())
        yield SSE_DONE
    finally:
        for stream in streams:
            stream.abort()
