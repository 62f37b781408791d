"""POST /v1/chat/completions, streamed and not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from llmserve.engine.async_llm import RequestStream
from llmserve.errors import InvalidRequestError, LLMServeError
from llmserve.outputs import RequestOutput
from llmserve.server import errors
from llmserve.server.logprobs import TokenTexts, chat_logprobs
from llmserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    DeltaMessage,
    Usage,
    now,
)
from llmserve.server.sampling import to_sampling_params
from llmserve.server.state import ServerState, get_state
from llmserve.server.streaming import (
    SSE_DONE,
    Delta,
    StreamCursor,
    event_stream,
    final_output,
    sse,
    until_disconnect,
)
from llmserve.server.submit import start_requests

router = APIRouter()


@dataclass
class _ChatContext:
    """What the response builders need to know about one chat request."""

    response_id: str
    model: str
    n: int
    top_logprobs: int | None  # None: no logprobs
    echo: str
    include_usage: bool
    texts: TokenTexts


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template takes them: text content, "developer" read as "system"."""
    converted = []
    for i, message in enumerate(messages):
        if message.content is None and message.role != "assistant":
            raise InvalidRequestError(
                f"A {message.role} message needs content.", param=f"messages[{i}].content"
            )
        converted.append(
            {"role": "system" if message.role == "developer" else message.role, "content": message.text()}
        )
    return converted


def _prompt_ids(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    return state.engine.tokenizer.apply_chat_template(
        template_messages(body.messages), add_generation_prompt=body.add_generation_prompt, tokenize=True
    )


def _echo_text(body: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's content when it is the assistant's (a continuation)."""
    last = body.messages[-1]
    return last.text() if body.echo and last.role == "assistant" else ""


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = get_state(request)
    state.check_model(body.model)
    errors.reject_unsupported(body.unsupported_params())
    prompt_ids = _prompt_ids(state, body)
    max_tokens, max_tokens_param = body.requested_max_tokens()
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = to_sampling_params(
        body, state.engine.default_sampling_params(), max_tokens, max_tokens_param, logprobs=top_logprobs
    )
    response_id, [stream] = await start_requests(
        state,
        "chatcmpl",
        [prompt_ids],
        params,
        body.priority,
        {"prompt": "messages", "max_tokens": max_tokens_param},
        body.cache_salt,
    )
    ctx = _ChatContext(
        response_id=response_id,
        model=body.model or state.served_model_name,
        n=body.n,
        top_logprobs=top_logprobs,
        echo=_echo_text(body),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        texts=state.token_texts,
    )
    if body.stream:
        return event_stream(_chat_events(stream, ctx))
    output = await until_disconnect(request, final_output(stream))
    return JSONResponse(_chat_response(output, ctx).model_dump())


# ---- non-streamed ---------------------------------------------------------------------------------


def _usage(output: RequestOutput) -> Usage:
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    return Usage.of(len(output.prompt_token_ids), completion_tokens, output.num_cached_tokens)


def _chat_response(output: RequestOutput, ctx: _ChatContext) -> ChatCompletionResponse:
    choices = []
    for completion in output.outputs:
        logprobs = None
        if ctx.top_logprobs is not None and completion.logprobs is not None:
            logprobs = chat_logprobs(completion.token_ids, completion.logprobs, ctx.top_logprobs, ctx.texts)
        choices.append(
            ChatChoice(
                index=completion.index,
                message=AssistantMessage(content=ctx.echo + completion.text),
                logprobs=logprobs,
                finish_reason=completion.finish_reason,
            )
        )
    return ChatCompletionResponse(id=ctx.response_id, model=ctx.model, choices=choices, usage=_usage(output))


# ---- streamed -------------------------------------------------------------------------------------


def _chunk_choice(index: int, delta: Delta, ctx: _ChatContext) -> ChatChunkChoice:
    logprobs = None
    if ctx.top_logprobs is not None and delta.logprobs is not None:
        logprobs = chat_logprobs(delta.token_ids, delta.logprobs, ctx.top_logprobs, ctx.texts)
    return ChatChunkChoice(
        index=index,
        delta=DeltaMessage(content=delta.text or None),
        logprobs=logprobs,
        finish_reason=delta.finish_reason,
    )


async def _chat_events(stream: RequestStream, ctx: _ChatContext) -> AsyncIterator[str]:
    created = now()

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse(
            ChatCompletionChunk(
                id=ctx.response_id, created=created, model=ctx.model, choices=choices, usage=usage
            )
        )

    try:
        first = [
            ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(ctx.n)
        ]
        yield chunk(first)
        if ctx.echo:
            yield chunk(
                [ChatChunkChoice(index=i, delta=DeltaMessage(content=ctx.echo)) for i in range(ctx.n)]
            )
        cursors = [StreamCursor() for _ in range(ctx.n)]
        last: RequestOutput | None = None
        async for output in stream:
            last = output
            deltas = [(o.index, cursors[o.index].advance(o)) for o in output.outputs]
            choices = [_chunk_choice(i, d, ctx) for i, d in deltas if d is not None]
            if choices:
                yield chunk(choices)
        if ctx.include_usage and last is not None:
            yield chunk([], _usage(last))
        yield SSE_DONE
    except LLMServeError as exc:  # the engine died or is shutting down mid-stream
        yield sse(errors.from_exception(exc).body_json())
        yield SSE_DONE
    finally:
        stream.abort()
