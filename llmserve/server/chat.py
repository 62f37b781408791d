"""POST /v1/chat/completions: the messages templated into a prompt (after a stored conversation's
history), run by the request pipeline in the chat shape; kept once answered when it asks to be stored
(server/stored_completions.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from llmserve.errors import InvalidRequestError
from llmserve.multimodal.inputs import PreparedImage
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.platform.content_routing import chat_texts
from llmserve.sampling.params import SamplingParams, ThinkingBudgetParams
from llmserve.server import errors
from llmserve.server.assistant_output import (
    ReplyPlan,
    plan_reply,
    reasoning_start,
    thinking_off,
    whole_tool_calls,
)
from llmserve.server.conversation_items import reply_message
from llmserve.server.conversations import (
    ConversationTurn,
    fit_history,
    open_turn,
    split_last_turn,
    turn_messages,
)
from llmserve.server.gateway import request_key
from llmserve.server.logprobs import TokenTexts, chat_logprobs, logprob_texts, vllm_prompt_logprobs
from llmserve.server.media import images_placed, load_images
from llmserve.server.messages import entry_image_urls, image_urls, template_messages
from llmserve.server.openapi import documented
from llmserve.server.pipeline import Choice, ChoiceRenderer, PreparedRequest, ResponseShape, respond
from llmserve.server.postprocess import MessagePieces, TextPostProcessor
from llmserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    DeltaMessage,
    Usage,
)
from llmserve.server.reasoning import ReasoningTokens
from llmserve.server.sampling import constraint_field, engine_kv_transfer, to_sampling_params
from llmserve.server.state import ModelEndpoint, ServerState, get_state
from llmserve.server.stored_completions import CompletionKeeper, keeper_for
from llmserve.server.streaming import Delta, StreamCursor, content_choice_json
from llmserve.server.templates import TemplateOptions, template_options
from llmserve.server.tool_calls import new_call_id

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None, responses=documented(ChatCompletionResponse, stream=True))
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = get_state(request)
    key = request_key(request.state)
    new_messages = template_messages(body.messages)
    turn = await open_turn(state.platform, key, body.conversation_id, body.parent_message_id, new_messages)
    keeper = keeper_for(state.platform, key, body)
    # A content router reads the stored conversation's turns too (its history_turns).
    endpoint = await state.routed_endpoint(body.model, key, key.id if key is not None else body.user,
                                           lambda: chat_texts(turn_messages(turn, new_messages)))
    errors.reject_unsupported(body.unsupported_params())
    plan = plan_reply(body, endpoint.tool_parser, endpoint.reasoning)
    endpoint.prompt_bound.check(sum(len(m["content"]) for m in new_messages), "messages")
    max_tokens, max_tokens_param = body.requested_max_tokens()
    urls = image_urls(body.messages)
    if turn is not None:  # the stored conversation's images come first
        urls = entry_image_urls(turn.history, "conversation_id") + urls
    images = await load_images(state, endpoint, urls, body.mm_processor_kwargs)
    prompt_text, prompt_ids = await _chat_prompt(state, endpoint, body, new_messages, turn, max_tokens, images)
    if images:
        prompt_ids = await state.workers.run(endpoint.engine.input_processor.place_images, prompt_ids, images)
    prompt_ids = endpoint.engine.input_processor.truncate(prompt_ids, body.truncate_prompt_tokens)
    top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = to_sampling_params(
        body, endpoint.engine.default_sampling_params(), max_tokens, max_tokens_param, logprobs=top_logprobs
    )
    params, constraint_param = _with_reply_plan(params, plan, body, prompt_text, endpoint.reasoning_end_ids)
    params = _with_thinking_budget(params, plan, body.thinking_token_budget, prompt_text, endpoint)
    reasoning = None if plan.reasoning is None else ReasoningTokens(
        endpoint.reasoning_start_ids, endpoint.reasoning_end_ids, plan.prompt_opened_reasoning)
    if body.prediction is not None:
        params = await _with_prediction(state, endpoint, params, body.prediction.text())
    renames = {"prompt": "messages", "max_tokens": max_tokens_param}
    if constraint_param is not None:
        renames["structured_outputs"] = constraint_param
    prepared = PreparedRequest(
        state=state,
        endpoint=endpoint,
        key=key,
        prompts=[prompt_ids],
        params=params,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        continuous_usage=bool(body.stream_options and body.stream_options.continuous_usage_stats),
        obfuscate=bool(body.stream_options and body.stream_options.include_obfuscation),
        resumable=bool(body.stream_options and body.stream_options.resumable),
        return_token_ids=body.return_token_ids,
        screen_texts=lambda: [m["content"] for m in new_messages],
        screen_param="messages",
        priority=body.priority,
        cache_salt=body.cache_salt,
        kv_transfer=engine_kv_transfer(body.kv_transfer_params),
        renames=renames,
        headers=turn.headers() if turn is not None else {},
        reasoning=reasoning,
    )
    shape = ChatShape(
        top_logprobs=top_logprobs,
        echo=_echo_text(body),
        texts=logprob_texts(endpoint.token_texts, body.return_tokens_as_token_ids),
        endpoint=endpoint,
        prompt_text=prompt_text,
        cache_salt=body.cache_salt,
        turn=turn,
        turn_messages=new_messages,
        prompt_logprobs=body.prompt_logprobs,
        plan=plan,
        prompt_token_ids=prompt_ids if body.return_token_ids else None,
        with_images=bool(images),
        keeper=keeper,
    )
    return await respond(request, prepared, shape)


def _with_reply_plan(
    params: SamplingParams, plan: ReplyPlan, body: ChatCompletionRequest, prompt_text: str, end_ids: list[int]
) -> tuple[SamplingParams, str | None]:
    """The sampling parameters with what the tools and the reasoning ask of decoding: the tools'
    schema as the output constraint (tool_choice "required" or named), special tokens kept when the
    tool-call format is written in them, structured output starting after the reasoning. Strict functions
    under tool_choice "auto" shape the calls unless a response_format is given, which then holds alone.
    Also the request field the constraint came from."""
    constraint, param = params.structured_outputs, constraint_field(body)
    if plan.structured_outputs is not None and (constraint is None or plan.calls_required):
        if constraint is not None:
            raise InvalidRequestError(
                f"tool_choice {body.tool_choice!r} constrains the reply to a tool call; it cannot be combined "
                f"with {param}.",
                param="tool_choice",
            )
        constraint, param = plan.structured_outputs, "tools"
    start_after = reasoning_start(plan, prompt_text, end_ids)
    if constraint is not None and start_after:
        constraint = dataclasses.replace(constraint, start_after=start_after)
    keep_special = plan.tool_parser is not None and plan.tool_parser.keep_special_tokens
    return dataclasses.replace(
        params,
        structured_outputs=constraint,
        skip_special_tokens=params.skip_special_tokens and not keep_special,
    ), param


def _with_thinking_budget(
    params: SamplingParams, plan: ReplyPlan, budget: int | None, prompt_text: str, endpoint: ModelEndpoint
) -> SamplingParams:
    """vLLM's thinking_token_budget: the reply's reasoning capped, counted from the first output token where the
    prompt opened it, else from the start tag the reply begins with; nothing to cap where the template closed an
    empty one (thinking turned off)."""
    if budget is None:
        return params
    if plan.reasoning is None:
        raise InvalidRequestError("thinking_token_budget needs a model served with a reasoning parser "
                                  "(--reasoning-parser): this one's replies have no reasoning part.",
                                  param="thinking_token_budget")
    if thinking_off(plan, prompt_text):
        return params
    start = [] if plan.prompt_opened_reasoning else endpoint.reasoning_start_ids
    try:
        return dataclasses.replace(params, thinking_budget=ThinkingBudgetParams(budget, endpoint.reasoning_end_ids,
                                                                                start))
    except InvalidRequestError as exc:  # what the budget cannot go with (beam search), named as the request has it
        exc.param = "thinking_token_budget"
        raise


def _echo_text(body: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's content when it is the assistant's (a continuation)."""
    last = body.messages[-1]
    return last.text() if body.echo and last.role == "assistant" else ""


def _template_options(body: ChatCompletionRequest, endpoint: ModelEndpoint, trusted: bool) -> TemplateOptions:
    """The chat template the request renders with and its variables: `chat_template_kwargs`, `documents`
    (server/templates.py), and `reasoning_effort` where the template reads it."""
    tokenizer = endpoint.engine.tokenizer
    options = template_options(tokenizer, trusted, body.chat_template, body.documents, body.chat_template_kwargs)
    variables = options.variables
    if body.reasoning_effort is None:
        return options
    if not options.reads(tokenizer, "reasoning_effort"):
        raise errors.unsupported("reasoning_effort", (
            f"reasoning_effort is not supported by {endpoint.name}: its chat template does not read it (a model "
            "that thinks may take a switch in chat_template_kwargs instead, such as Qwen3's enable_thinking)."
        ))
    if variables.setdefault("reasoning_effort", body.reasoning_effort) != body.reasoning_effort:
        raise errors.unsupported("reasoning_effort", "reasoning_effort and chat_template_kwargs.reasoning_effort "
                                 "differ: give it once.")
    return options


async def _with_prediction(state: ServerState, endpoint: ModelEndpoint, params: SamplingParams,
                           prediction: str) -> SamplingParams:
    """The params with the predicted output and its tokens (tokenized on a worker thread)."""
    ids = await state.workers.run(endpoint.engine.input_processor.prediction_token_ids, prediction)
    return dataclasses.replace(params, prediction=prediction, prediction_token_ids=ids)


async def _chat_prompt(
    state: ServerState,
    endpoint: ModelEndpoint,
    body: ChatCompletionRequest,
    new_messages: list[dict[str, Any]],
    turn: ConversationTurn | None,
    max_tokens: int | None,
    images: list[PreparedImage],
) -> tuple[str, list[int]]:
    """The templated, tokenized prompt (on a worker thread): a conversation's history (fitted to the
    context window as `truncation` says, leaving room for `max_tokens`), then the new messages; without a
    conversation, the messages' own turns before the last are the history fitted. The request's
    `chat_template_kwargs` are the template's variables too."""

    # (compiling a request's own template grows with it: on a worker thread)
    options = await state.workers.run(_template_options, body, endpoint, state.trust_request_chat_template)
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None
    tokenizer, processor = endpoint.engine.tokenizer, endpoint.engine.input_processor

    def render(messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
        messages = images_placed(endpoint, messages)
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, tools=tools,
            continue_final_message=body.continue_final_message, chat_template=options.template, **options.variables,
        )
        return text, processor.expand_placeholders(endpoint.continuations.encode(text, body.cache_salt), images)

    if turn is not None:
        history = turn.history
    else:  # the request's own earlier turns are the history that `truncation: "auto"` may cut
        history, new_messages = split_last_turn(new_messages)
    max_prompt_tokens = endpoint.engine.max_model_len - (max_tokens or 1)
    text, ids, truncated = await state.workers.run(
        fit_history, render, history, new_messages, max_prompt_tokens, body.truncation
    )
    if turn is not None:
        turn.truncated = truncated
    return text, ids


# ---- the chat shape -------------------------------------------------------------------------------


class ChatChoiceRenderer(ChoiceRenderer):
    """A chat choice: its released text, through its post-processor when it has one (else the text is
    the content as is), becomes the assistant message or its deltas."""

    def __init__(
        self, index: int, top_logprobs: int | None, texts: TokenTexts, echo: str, processor: TextPostProcessor | None,
        token_ids: bool = False,
    ) -> None:
        self.index = index
        self.top_logprobs = top_logprobs  # None: no logprobs
        self.texts = texts
        self.echo = echo  # prepended to the non-streamed content (streamed, it has a chunk of its own)
        self.processor = processor
        self.token_ids = token_ids  # vLLM's return_token_ids

    def chunk_choice(self, delta: Delta, output: RequestOutput) -> Choice | None:
        plain = self.top_logprobs is None or delta.logprobs is None
        if self.processor is None and plain and not self.token_ids:
            return content_choice_json(self.index, delta.text, delta.finish_reason)  # the hot path
        pieces, finish_reason = self._pieces(delta.text, delta.finish_reason)
        logprobs = None
        if not plain:
            logprobs = chat_logprobs(delta.token_ids, delta.logprobs, self.top_logprobs, self.texts)
        elif not self.token_ids and pieces.is_content_only:
            if not pieces.content and finish_reason is None:
                return None  # the post-processor holds this text back
            return content_choice_json(self.index, pieces.content, finish_reason)
        return ChatChunkChoice(
            index=self.index, delta=_delta_message(pieces), logprobs=logprobs, finish_reason=finish_reason,
            token_ids=list(delta.token_ids) if self.token_ids else None,
        )

    def response_choice(
        self, completion: CompletionOutput, text: str, finish_reason: str | None, output: RequestOutput
    ) -> ChatChoice:
        pieces, finish_reason = self._pieces(text, finish_reason)
        logprobs = None
        if self.top_logprobs is not None and completion.logprobs is not None:
            logprobs = chat_logprobs(completion.token_ids, completion.logprobs, self.top_logprobs, self.texts)
        content: str | None = self.echo + pieces.content
        if not content and pieces.tool_calls:
            content = None  # as OpenAI: a message of tool calls alone has no content
        message = AssistantMessage(
            content=content,
            reasoning_content=pieces.reasoning_content or None,
            tool_calls=whole_tool_calls(pieces.tool_calls) or None,
        )
        return ChatChoice(index=self.index, message=message, logprobs=logprobs, finish_reason=finish_reason,
                          token_ids=list(completion.token_ids) if self.token_ids else None)

    def _pieces(self, text: str, finish_reason: str | None) -> tuple[MessagePieces, str | None]:
        """What the newly released `text` adds to the message, and the finish reason to report."""
        if self.processor is None:
            return MessagePieces(content=text), finish_reason
        pieces = self.processor.feed(text)
        if finish_reason is not None:
            held, finish_reason = self.processor.finish(finish_reason)
            pieces.extend(held)
        return pieces, finish_reason


def _delta_message(pieces: MessagePieces) -> DeltaMessage:
    return DeltaMessage(
        content=pieces.content or None,
        reasoning_content=pieces.reasoning_content or None,
        tool_calls=pieces.tool_calls or None,
    )


class ChatShape(ResponseShape):
    """chat.completion(.chunk) bodies; a completed request's replies are remembered for the next turn
    (their exact tokens) and, in a stored conversation, saved with the turn; the response is kept when the
    request asked to be stored."""

    id_prefix = "chatcmpl"

    def __init__(
        self,
        top_logprobs: int | None,
        echo: str,
        texts: TokenTexts,
        endpoint: ModelEndpoint,
        prompt_text: str,
        cache_salt: str | None,
        turn: ConversationTurn | None,
        turn_messages: list[dict[str, Any]],
        prompt_logprobs: int | None = None,
        plan: ReplyPlan | None = None,
        prompt_token_ids: list[int] | None = None,
        with_images: bool = False,
        keeper: CompletionKeeper | None = None,
    ) -> None:
        self.keeper = keeper  # `store: true`: where the response goes
        self.with_images = with_images  # its prompt's ids hold images' expanded placeholders: not remembered
        self.plan = plan  # the tool calls and reasoning replies are parsed for (None: plain content)
        self.prompt_token_ids = prompt_token_ids  # vLLM's return_token_ids: the response carries them
        self.top_logprobs = top_logprobs
        self.prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs field, with this many top logprobs
        self.echo = echo
        self.texts = texts
        self.endpoint = endpoint
        self.prompt_text = prompt_text
        self.cache_salt = cache_salt
        self.turn = turn
        self.turn_messages = turn_messages
        self._sent_call_ids: dict[int, list[str]] = {}

    def renderer(self, position: int, index: int) -> ChatChoiceRenderer:
        return ChatChoiceRenderer(index, self.top_logprobs, self.texts, self.echo, self._post_processor(index),
                                  token_ids=self.prompt_token_ids is not None)

    def _post_processor(self, index: int) -> TextPostProcessor | None:
        """A fresh post-processor for choice `index` (a tool-call or reasoning parser); None: the text is
        the content as is."""
        return self.plan.parser(self._call_ids(index)) if self.plan is not None else None

    def _call_ids(self, index: int) -> Callable[[], str]:
        """The ids of choice `index`'s tool calls: new ones the first time it is rendered (kept), the same ones, in
        order, every later time (a streamed response rendered whole, as its client was sent it)."""
        sent = self._sent_call_ids.get(index)
        if sent is None:
            sent = self._sent_call_ids[index] = []

            def recorded() -> str:
                sent.append(new_call_id())
                return sent[-1]

            return recorded
        replayed = iter(list(sent))
        return lambda: next(replayed, None) or new_call_id()

    def empty_chunk(self, response_id: str, created: int, model: str, usage: Usage | None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=response_id, created=created, model=model, choices=[], usage=usage)

    def first_chunk(self, response_id: str, created: int, model: str) -> ChatCompletionChunk | None:
        if self.prompt_token_ids is None:
            return None
        return ChatCompletionChunk(id=response_id, created=created, model=model, choices=[],
                                   prompt_token_ids=self.prompt_token_ids)

    def response(
        self, response_id: str, model: str, choices: list[BaseModel], usage: Usage, outputs: Sequence[RequestOutput]
    ) -> ChatCompletionResponse:
        prompt_logprobs = vllm_prompt_logprobs(outputs[0].prompt_logprobs, self.prompt_logprobs)
        return ChatCompletionResponse(
            id=response_id, model=model, choices=choices, usage=usage, prompt_logprobs=prompt_logprobs,
            prompt_token_ids=None if self.prompt_token_ids is None else list(outputs[0].prompt_token_ids),
            kv_transfer_params=outputs[0].kv_transfer_params,
        )

    def opening_chunks(self, prompts: int, n: int) -> list[list[Choice]]:
        chunks: list[list[Choice]] = [
            [ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(n)]
        ]
        if self.echo:
            chunks.append([ChatChunkChoice(index=i, delta=DeltaMessage(content=self.echo)) for i in range(n)])
        return chunks

    async def completed(self, outputs: Sequence[RequestOutput], cursors: Sequence[StreamCursor], blocked: bool,
                        response: Callable[[], dict]) -> None:
        output = outputs[0]
        # A prompt with images is not remembered: its ids hold each image's placeholder expanded, which the next
        # turn's template writes once (and expands again).
        if not blocked and output.finished and not self.with_images:
            self._remember_replies(output)
        if self.turn is not None:
            await self.turn.save(self.turn_messages, self._reply(output, cursors[0], response),
                                 len(output.outputs[0].token_ids))
        if self.keeper is not None:
            await self.keeper.save(response())

    def _reply(self, output: RequestOutput, cursor: StreamCursor, response: Callable[[], dict]) -> dict[str, Any]:
        """The first choice as its stored conversation keeps it: where it was parsed for tool calls or reasoning,
        its content, calls and reasoning as the client got them; else its whole text, as the safety guard let it
        out."""
        if self.plan is not None and self.plan.parses_anything:
            message = response()["choices"][0]["message"]
            return reply_message(message.get("content") or "", message.get("tool_calls"),
                                 message.get("reasoning_content"))
        guard = cursor.guard
        return reply_message(guard.released_text if guard is not None else output.outputs[0].text)

    def _remember_replies(self, output: RequestOutput) -> None:
        """Let the next turn of this conversation reuse the replies' exact tokens (and so their KV)."""
        for completion in output.outputs:
            if completion.finish_reason in ("stop", "length"):
                self.endpoint.continuations.remember(
                    self.prompt_text, output.prompt_token_ids, completion.text, completion.token_ids, self.cache_salt
                )
