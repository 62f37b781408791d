"""POST /v1/completions (the legacy text API), streamed and not.

A list of prompts fans out into one engine request per prompt; choice j of prompt i gets index i*n+j,
as OpenAI numbers them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from llmserve.errors import LLMServeError
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.platform.safety import OutputGuard
from llmserve.server import errors
from llmserve.server.gateway import request_key
from llmserve.server.logprobs import (
    TokenTexts,
    completion_logprobs,
    echoed_completion_logprobs,
    vllm_prompt_logprobs,
)
from llmserve.server.openapi import documented
from llmserve.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
    now,
)
from llmserve.server.sampling import to_sampling_params
from llmserve.server.state import ModelEndpoint, ServerState, get_state
from llmserve.server.streaming import (
    SSE_DONE,
    ChunkEnvelope,
    StreamCursor,
    event_stream,
    final_outputs,
    merged,
    sse,
    text_choice_json,
)
from llmserve.server.submit import (
    Started,
    check_request_size,
    count_output_blocks,
    screen_prompts,
    start_requests,
)

router = APIRouter()


@dataclass
class _CompletionContext:
    response_id: str
    model: str
    n: int
    logprobs: int | None
    echo_texts: list[str]  # per prompt: the text echoed before its choices ("" without echo)
    echo_logprobs: bool  # the prompt's tokens lead each choice's logprobs
    prompt_logprobs: int | None  # vLLM's prompt_logprobs field, with this many top logprobs
    include_usage: bool
    texts: TokenTexts
    state: ServerState
    started: Started

    def count_blocks(self, cursors: Iterable[StreamCursor]) -> bool:
        return count_output_blocks(self.state, self.model, self.response_id, cursors)


@router.post("/v1/completions", response_model=None, responses=documented(CompletionResponse, stream=True))
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = get_state(request)
    key = request_key(request.state)
    endpoint = state.endpoint(body.model, key, routing_key=key.id if key is not None else body.user)
    errors.reject_unsupported(body.unsupported_params())
    params = to_sampling_params(
        body, endpoint.engine.default_sampling_params(), body.max_tokens, logprobs=body.logprobs
    )
    prompts = body.prompts()
    for prompt in prompts:
        if isinstance(prompt, str):
            endpoint.prompt_bound.check(len(prompt))
    prompt_ids = await state.workers.run(_tokenize, endpoint, prompts, body.truncate_prompt_tokens)
    check_request_size(endpoint, prompt_ids, params)
    await screen_prompts(state, endpoint, lambda: [_prompt_text(p, endpoint.token_texts) for p in prompts], "prompt")
    started = await start_requests(
        state, endpoint, key, "cmpl", prompt_ids, params, body.priority, cache_salt=body.cache_salt
    )
    ctx = _CompletionContext(
        response_id=started.response_id,
        model=endpoint.name,
        n=body.n,
        logprobs=body.logprobs,
        echo_texts=[_prompt_text(p, endpoint.token_texts) if body.echo else "" for p in prompts],
        echo_logprobs=body.echoes_logprobs,
        prompt_logprobs=body.prompt_logprobs,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        texts=endpoint.token_texts,
        state=state,
        started=started,
    )
    if body.stream:
        return event_stream(_completion_events(ctx), started.headers)
    outputs = await started.run_to_end(request, final_outputs(started.streams, started.meter.observe))
    response, blocked = _completion_response(outputs, ctx)
    await started.meter.finish_durably("content_filter" if blocked else "completed")
    return JSONResponse(response.model_dump(), headers=started.headers)


def _tokenize(
    endpoint: ModelEndpoint, prompts: Sequence[str | list[int]], keep: int | None
) -> list[list[int]]:
    """Text prompts encoded, id prompts checked against the vocabulary (before anything decodes them),
    truncated to `truncate_prompt_tokens`."""
    processor = endpoint.engine.input_processor
    return [processor.truncate(processor.tokenize(p), keep) for p in prompts]


def _prompt_text(prompt: str | list[int], texts: TokenTexts) -> str:
    return prompt if isinstance(prompt, str) else texts.decode(prompt)


def _usage(outputs: Sequence[RequestOutput]) -> Usage:
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return Usage.of(prompt_tokens, completion_tokens, sum(o.num_cached_tokens for o in outputs))


# ---- non-streamed ---------------------------------------------------------------------------------


def _choice(
    position: int, output: RequestOutput, completion: CompletionOutput, ctx: _CompletionContext,
    cursor: StreamCursor,
) -> CompletionChoice:
    prefix = ctx.echo_texts[position]
    text, finish_reason = cursor.visible(completion)
    logprobs = None
    if ctx.logprobs is not None and completion.logprobs is not None:
        logprobs = (
            echoed_completion_logprobs(output, completion.token_ids, completion.logprobs, ctx.logprobs, ctx.texts)
            if ctx.echo_logprobs
            else completion_logprobs(completion.token_ids, completion.logprobs, ctx.logprobs, ctx.texts, len(prefix))
        )
    return CompletionChoice(
        index=position * ctx.n + completion.index,
        text=prefix + text,
        logprobs=logprobs,
        finish_reason=finish_reason,
        prompt_logprobs=vllm_prompt_logprobs(output.prompt_logprobs, ctx.prompt_logprobs),
    )


def _completion_response(
    outputs: Sequence[RequestOutput], ctx: _CompletionContext
) -> tuple[CompletionResponse, bool]:
    cursors: list[StreamCursor] = []
    choices = []
    for position, output in enumerate(outputs):
        for completion in output.outputs:
            cursors.append(StreamCursor(ctx.state.output_guard()))
            choices.append(_choice(position, output, completion, ctx, cursors[-1]))
    response = CompletionResponse(id=ctx.response_id, model=ctx.model, choices=choices, usage=_usage(outputs))
    return response, ctx.count_blocks(cursors)


# ---- streamed -------------------------------------------------------------------------------------


class _ChoiceCursor(StreamCursor):
    """A completion choice's stream position, plus the text offset its logprobs report next."""

    def __init__(self, index: int, text_offset: int, guard: OutputGuard | None) -> None:
        super().__init__(guard)
        self.index = index
        self.offset = text_offset  # text_offset of the next token (after an echoed prompt)

    def next_choice(self, completion: CompletionOutput, ctx: _CompletionContext) -> CompletionChoice | str | None:
        """The next chunk's choice (as JSON when it has no logprobs), or None when there is none yet."""
        delta = self.advance(completion)
        if delta is None:
            return None
        if ctx.logprobs is None or delta.logprobs is None:
            return text_choice_json(self.index, delta.text, delta.finish_reason)
        logprobs = completion_logprobs(delta.token_ids, delta.logprobs, ctx.logprobs, ctx.texts, self.offset)
        self.offset += sum(len(t) for t in logprobs.tokens)
        return CompletionChoice(index=self.index, text=delta.text, logprobs=logprobs, finish_reason=delta.finish_reason)


async def _completion_events(ctx: _CompletionContext) -> AsyncIterator[str]:
    created = now()
    streams, meter = ctx.started.streams, ctx.started.meter
    status = "disconnected"  # unless the streams get to their end

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return sse(
            CompletionResponse(
                id=ctx.response_id, created=created, model=ctx.model, choices=choices, usage=usage
            )
        )

    envelope = ChunkEnvelope(CompletionResponse(id=ctx.response_id, created=created, model=ctx.model, choices=[],
                                                usage=None))

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
            meter.observe(position, output)
            choices = []
            for completion in output.outputs:
                index = position * ctx.n + completion.index
                cursor = cursors.get(index)
                if cursor is None:
                    offset = len(ctx.echo_texts[position])
                    cursor = cursors[index] = _ChoiceCursor(index, offset, ctx.state.output_guard())
                choice = cursor.next_choice(completion, ctx)
                if choice is not None:
                    choices.append(choice)
            choice_cursors = [cursors.get(position * ctx.n + j) for j in range(ctx.n)]
            if output.finished or all(c is not None and c.done for c in choice_cursors):
                finals[position] = output
                if not output.finished:
                    streams[position].abort()  # every choice was stopped by the output filter
            if choices:
                yield envelope.event(choices)
            if len(finals) == len(streams):
                break
        status = "content_filter" if ctx.count_blocks(cursors.values()) else "completed"
        if ctx.include_usage:
            yield chunk([], _usage([finals[i] for i in sorted(finals)]))
        await meter.finish_durably(status)  # metered before the client sees the end
        yield SSE_DONE
    except LLMServeError as exc:  # the engine died or is shutting down mid-stream
        status = "error"
        yield sse(errors.from_exception(exc).body_json())
        await meter.finish_durably(status)
        yield SSE_DONE
    finally:
        ctx.started.abort(status)
