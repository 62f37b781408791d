"""POST /v1/chat/completions, streamed and not."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from llmserve.errors import InvalidRequestError, LLMServeError
from llmserve.outputs import RequestOutput
from llmserve.server import errors
from llmserve.server.conversations import ConversationTurn, fit_history, open_turn
from llmserve.server.gateway import request_key
from llmserve.server.logprobs import TokenTexts, chat_logprobs, vllm_prompt_logprobs
from llmserve.server.openapi import documented
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
from llmserve.server.state import ModelEndpoint, ServerState, get_state
from llmserve.server.streaming import (
    SSE_DONE,
    ChunkEnvelope,
    Delta,
    StreamCursor,
    content_choice_json,
    event_stream,
    final_output,
    sse,
)
from llmserve.server.submit import (
    Started,
    check_request_size,
    count_output_blocks,
    screen_prompts,
    start_requests,
)
from llmserve.server.workers import WorkerPool

router = APIRouter()


@dataclass
class _ChatContext:
    """What the response builders need to know about one chat request."""

    response_id: str
    model: str
    n: int
    top_logprobs: int | None  # None: no logprobs
    prompt_logprobs: int | None  # vLLM's prompt_logprobs field, with this many top logprobs
    echo: str
    include_usage: bool
    texts: TokenTexts
    state: ServerState
    started: Started
    turn: ConversationTurn | None
    endpoint: ModelEndpoint
    prompt_text: str
    cache_salt: str | None

    def cursors(self) -> list[StreamCursor]:
        return [StreamCursor(self.state.output_guard()) for _ in range(self.n)]

    def count_blocks(self, cursors: Iterable[StreamCursor]) -> bool:
        return count_output_blocks(self.state, self.model, self.response_id, cursors)

    def remember_replies(self, output: RequestOutput) -> None:
        """Let the next turn of this conversation reuse the replies' exact tokens (and so their KV)."""
        for completion in output.outputs:
            if completion.finish_reason in ("stop", "length"):
                self.endpoint.continuations.remember(
                    self.prompt_text, output.prompt_token_ids, completion.text, completion.token_ids,
                    self.cache_salt,
                )

    async def save_turn(self, messages: list[ChatMessage], reply: str, reply_tokens: int) -> None:
        if self.turn is not None:
            await self.turn.save(template_messages(messages), reply, reply_tokens)


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


def _echo_text(body: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's content when it is the assistant's (a continuation)."""
    last = body.messages[-1]
    return last.text() if body.echo and last.role == "assistant" else ""


async def _chat_prompt(
    workers: WorkerPool,
    endpoint: ModelEndpoint,
    body: ChatCompletionRequest,
    new_messages: list[dict[str, str]],
    turn: ConversationTurn | None,
    max_tokens: int | None,
) -> tuple[str, list[int]]:
    """The templated, tokenized prompt: a conversation's history (fitted to the context window as
    `truncation` says, leaving room for `max_tokens`), then the new messages."""

    def render(messages: list[dict[str, str]]) -> tuple[str, list[int]]:
        text = endpoint.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
        return text, endpoint.continuations.encode(text, body.cache_salt)

    history = turn.history if turn is not None else []
    max_prompt_tokens = endpoint.engine.max_model_len - (max_tokens or 1)
    text, ids, truncated = await workers.run(
        fit_history, render, history, new_messages, max_prompt_tokens, body.truncation
    )
    if turn is not None:
        turn.truncated = truncated
    return text, ids


@router.post("/v1/chat/completions", response_model=None, responses=documented(ChatCompletionResponse, stream=True))
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = get_state(request)
    key = request_key(request.state)
    endpoint = state.endpoint(body.model, key, routing_key=key.id if key is not None else body.user)
    errors.reject_unsupported(body.unsupported_params())
    new_messages = template_messages(body.messages)
    endpoint.prompt_bound.check(sum(len(m["content"]) for m in new_messages), "messages")
    turn = await open_turn(state, key, body.conversation_id, body.parent_message_id, new_messages)
    max_tokens, max_tokens_param = body.requested_max_tokens()
    prompt_text, prompt_ids = await _chat_prompt(state.workers, endpoint, body, new_messages, turn, max_tokens)
    prompt_ids = endpoint.engine.input_processor.truncate(prompt_ids, body.truncate_prompt_tokens)
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = to_sampling_params(
        body, endpoint.engine.default_sampling_params(), max_tokens, max_tokens_param, logprobs=top_logprobs
    )
    renames = {"prompt": "messages", "max_tokens": max_tokens_param}
    check_request_size(endpoint, [prompt_ids], params, renames)
    await screen_prompts(state, endpoint, lambda: [m["content"] for m in new_messages], "messages")
    started = await start_requests(
        state,
        endpoint,
        key,
        "chatcmpl",
        [prompt_ids],
        params,
        body.priority,
        renames,
        body.cache_salt,
    )
    ctx = _ChatContext(
        response_id=started.response_id,
        model=endpoint.name,
        n=body.n,
        top_logprobs=top_logprobs,
        prompt_logprobs=body.prompt_logprobs,
        echo=_echo_text(body),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        texts=endpoint.token_texts,
        state=state,
        started=started,
        turn=turn,
        endpoint=endpoint,
        prompt_text=prompt_text,
        cache_salt=body.cache_salt,
    )
    headers = {**started.headers, **(turn.headers() if turn is not None else {})}
    if body.stream:
        return event_stream(_chat_events(ctx, body.messages), headers)
    output = await started.run_to_end(request, final_output(started.streams[0], started.meter.observe))
    response, blocked = _chat_response(output, ctx)
    await started.meter.finish_durably("content_filter" if blocked else "completed")
    if not blocked:
        ctx.remember_replies(output)
    first = response.choices[0]
    await ctx.save_turn(body.messages, first.message.content or "", len(output.outputs[0].token_ids))
    return JSONResponse(response.model_dump(), headers=headers)


# ---- non-streamed ---------------------------------------------------------------------------------


def _usage(output: RequestOutput) -> Usage:
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    return Usage.of(len(output.prompt_token_ids), completion_tokens, output.num_cached_tokens)


def _chat_response(output: RequestOutput, ctx: _ChatContext) -> tuple[ChatCompletionResponse, bool]:
    choices = []
    cursors = ctx.cursors()
    for completion in output.outputs:
        text, finish_reason = cursors[completion.index].visible(completion)
        logprobs = None
        if ctx.top_logprobs is not None and completion.logprobs is not None:
            logprobs = chat_logprobs(completion.token_ids, completion.logprobs, ctx.top_logprobs, ctx.texts)
        choices.append(
            ChatChoice(
                index=completion.index,
                message=AssistantMessage(content=ctx.echo + text),
                logprobs=logprobs,
                finish_reason=finish_reason,
            )
        )
    response = ChatCompletionResponse(id=ctx.response_id, model=ctx.model, choices=choices, usage=_usage(output),
                                      prompt_logprobs=vllm_prompt_logprobs(output.prompt_logprobs, ctx.prompt_logprobs))
    return response, ctx.count_blocks(cursors)


# ---- streamed -------------------------------------------------------------------------------------


def _chunk_choice(index: int, delta: Delta, ctx: _ChatContext) -> ChatChunkChoice | str:
    """A chunk's choice (as JSON when it has no logprobs)."""
    if ctx.top_logprobs is None or delta.logprobs is None:
        return content_choice_json(index, delta.text, delta.finish_reason)
    return ChatChunkChoice(
        index=index,
        delta=DeltaMessage(content=delta.text or None),
        logprobs=chat_logprobs(delta.token_ids, delta.logprobs, ctx.top_logprobs, ctx.texts),
        finish_reason=delta.finish_reason,
    )


async def _chat_events(ctx: _ChatContext, messages: list[ChatMessage]) -> AsyncIterator[str]:
    created = now()
    stream, meter = ctx.started.streams[0], ctx.started.meter
    status = "disconnected"  # unless the stream gets to its end

    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return sse(
            ChatCompletionChunk(
                id=ctx.response_id, created=created, model=ctx.model, choices=choices, usage=usage
            )
        )

    envelope = ChunkEnvelope(ChatCompletionChunk(id=ctx.response_id, created=created, model=ctx.model, choices=[]))

    try:
        first = [
            ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(ctx.n)
        ]
        yield chunk(first)
        if ctx.echo:
            yield chunk(
                [ChatChunkChoice(index=i, delta=DeltaMessage(content=ctx.echo)) for i in range(ctx.n)]
            )
        cursors = ctx.cursors()
        last: RequestOutput | None = None
        async for output in stream:
            meter.observe(0, output)
            last = output
            deltas = [(o.index, cursors[o.index].advance(o)) for o in output.outputs]
            choices = [_chunk_choice(i, d, ctx) for i, d in deltas if d is not None]
            if choices:
                yield envelope.event(choices)
            if all(c.done for c in cursors) and not output.finished:
                stream.abort()  # every choice was stopped by the output filter
                break
        status = "content_filter" if ctx.count_blocks(cursors) else "completed"
        if status == "completed" and last is not None and last.finished:
            ctx.remember_replies(last)
        if ctx.include_usage and last is not None:
            yield chunk([], _usage(last))
        if last is not None:
            reply = cursors[0].guard.released_text if cursors[0].guard is not None else last.outputs[0].text
            await ctx.save_turn(messages, reply, len(last.outputs[0].token_ids))
        await meter.finish_durably(status)  # metered before the client sees the end
        yield SSE_DONE
    except LLMServeError as exc:  # the engine died or is shutting down mid-stream
        status = "error"
        yield sse(errors.from_exception(exc).body_json())
        await meter.finish_durably(status)
        yield SSE_DONE
    finally:
        ctx.started.abort(status)
