"""The platform in front of the pools: `llmserve serve`'s platform services (server/gateway.py's
`Platform`: keys, rate limits, usage, conversations, safety) around replicas instead of engines.

A chat or completion request goes one way:
  the key (`AuthMiddleware`, before this) → the model or alias (a canary alias picks a pool, the same
  one for the same key or user) → the body validated as the server validates it → a stored
  conversation's history put before the new messages (fitted to the context window with
  `truncation: "auto"`) → the safety screen over the new input → the rate limits: a request, and for a
  key with a token limit the prompt plus its completion budget, the prompt counted by a replica's
  /tokenize (its own tokenizer, chat template and the tools) → forwarded to a replica by the proxy →
  relayed (relay.py: the output screened, the usage counted from the replica's reports; a non-streamed
  reply comes as usage reports, then the response, whole.py) → metered, the reservation settled to
  the usage the replica reported (a broken stream, or a request its client left, to what it had
  reported) → the reply stored in the conversation. A resumable stream is buffered here, and resumed
  from here (resume.py); past the shutdown timeout every stream ends with an error (shutdown.py).

An embeddings request goes the same way where it applies: the key → the model or alias → the body
validated → the safety screen over its text inputs → the rate limits (its inputs' tokens, counted by
one /tokenize call, no completion) → forwarded to a replica → its reply passed on as the replica wrote
it, metered with its `usage`.

A chat or completion its pool disaggregates (disaggregation.py) is metered as any other: with the usage
the decode replica reports, the prefill call's own never counted (the proxy makes it and reads its answer,
which never reaches the relay); a client's `kv_transfer_params` are a 400, as they are the gateway's own.

A request the replica refuses as invalid (a 4xx) is not metered and counts against no limit, as the
server refuses such a request before admitting it; one no replica could take is not metered and gives
its tokens back (its request still counts, as the server's when its engine fails to take it)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmserve.gateway.disaggregation import KV_TRANSFER_PARAMS
from llmserve.gateway.errors import error_body, kv_transfer_params_refused
from llmserve.gateway.fold import ChatFold
from llmserve.gateway.pool import Pool
from llmserve.gateway.proxy import Proxy, forwarded_headers, prompt_cache_key, prompt_key
from llmserve.gateway.relay import CONTENT_FILTER, RelayMeter, Reply, StreamRelay
from llmserve.gateway.resume import resumable_response
from llmserve.gateway.shutdown import GuardedStream, StreamCutoff
from llmserve.gateway.whole import WholeForwarding, WholeReply
from llmserve.platform.content_routing import ContentRouter, chat_texts, prompt_texts
from llmserve.platform.keys import ApiKey
from llmserve.platform.moderation import CONTENT_FILTER_MODEL
from llmserve.platform.routing import ModelRouter
from llmserve.platform.safety import OutputGuard
from llmserve.platform.usage import UsageStatus
from llmserve.server import errors
from llmserve.server.chat_translation import chat_tokenize_body
from llmserve.server.conversation_items import reply_message
from llmserve.server.conversations import ConversationTurn, fit_history, open_turn, turn_messages
from llmserve.server.errors import APIError, ClientDisconnected
from llmserve.server.gateway import Admission, Platform, request_key
from llmserve.server.messages import template_messages, wire_messages
from llmserve.server.moderators import choose_moderator, moderate_by_filter
from llmserve.server.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    EmbeddingRequest,
    ModerationRequest,
    RerankRequest,
    ScoreRequest,
    random_id,
    texts_by_field,
)
from llmserve.server.stored_completions import CompletionKeeper, keeper_for
from llmserve.server.streaming import PROGRESS_HEADER, StreamRegistry, until_disconnect
from llmserve.server.workers import WorkerPool

# The platform's request fields: the gateway acts on them, the replicas (without a platform) never see them.
PLATFORM_FIELDS = ("conversation_id", "parent_message_id", "truncation", "store", "metadata")
JSON_HEADERS = {"content-type": "application/json"}


@dataclass
class _Call:
    """One request on its way through the gateway's platform."""

    path: str
    id_prefix: str  # of the response id: "chatcmpl", "cmpl", "embd"
    text_field: str | None  # where a choice's text is: "content" (chat), "text" (completions); None: no choices
    model: str
    pool: Pool
    key: ApiKey | None
    payload: dict[str, Any]  # the body sent to the replica
    stream: bool
    include_usage: bool  # what the client asked for (the replica is always asked for the usage)
    continuous_usage: bool
    choices: int  # n × prompts
    obfuscate: bool = False  # the client's chunks padded (`include_obfuscation`), after the gateway's rewrite
    resumable: bool = False  # streamed into the gateway's buffer, to be resumed from it (resume.py)
    reserve_tokens: int = 0
    prompt_tokens: int = 0  # as far as known before the replica answers
    turn: ConversationTurn | None = None
    turn_messages: list[dict[str, Any]] = field(default_factory=list)
    keeper: CompletionKeeper | None = None  # `store: true`: where the completion goes once answered
    keeps_calls: bool = False  # a stored conversation's turn that offered tools: the reply's calls are kept too


@dataclass(frozen=True)
class _Pooled:
    """A request answered from embeddings: where it goes, the texts the replica embeds (each once), how it
    truncates them, which texts the safety filter reads under which field name, and for a score or rerank
    the pairs scored (places in `inputs`)."""

    path: str
    id_prefix: str
    model: str | None
    user: str | None
    inputs: Sequence[str | list[int]]
    truncate: int | None
    screened: list[tuple[Sequence[str | list[int]], str]]
    pairs: Sequence[tuple[int, int]] | None = None


def _scored(path: str, id_prefix: str, body: ScoreRequest | RerankRequest) -> _Pooled:
    """A score or rerank request: an embedding model embeds each of its texts once, a cross-encoder reads each
    pair whole; each text screened by the field it came from."""
    texts = body.scored_texts()
    screened = [(fielded, field) for field, fielded in texts_by_field(texts.items, texts.params).items()]
    return _Pooled(path, id_prefix, body.model, body.user, texts.items, body.truncate_prompt_tokens, screened,
                   body.scored_pairs(texts))


class GatewayPlatform:
    def __init__(
        self, platform: Platform, router: ModelRouter[Pool], proxy: Proxy, workers: WorkerPool,
        streams: StreamRegistry | None = None,
    ) -> None:
        self.platform = platform
        self.router = router
        self.proxy = proxy
        self.workers = workers
        self.streams = streams if streams is not None else StreamRegistry()  # the resumable streams it relays
        self.content_routers: dict[str, ContentRouter] = {}  # model names routed by the request's text
        self.cutoff = StreamCutoff()

    def end_streams(self) -> None:
        """The shutdown ran out of time: every stream still relayed ends with an error event, metered
        as aborted by the server."""
        self.platform.aborting = True
        self.cutoff.cut_all()

    # ---- the endpoints ----------------------------------------------------------------------------
    async def chat(self, request: Request, body: ChatCompletionRequest, payload: dict[str, Any] | None = None) -> Response:
        """`payload`: the body as JSON when it is not the request's own (a Responses API request's chat)."""
        if payload is None and KV_TRANSFER_PARAMS in await _json(request):
            return kv_transfer_params_refused()
        key = request_key(request.state)
        new_messages = template_messages(body.messages)
        turn = await open_turn(self.platform, key, body.conversation_id, body.parent_message_id, new_messages)
        keeper = keeper_for(self.platform, key, body)
        # A content router reads the stored conversation's turns too (its history_turns).
        model, pool = await self.routed(body.model, key, key.id if key is not None else body.user,
                                        lambda: chat_texts(turn_messages(turn, new_messages)))
        errors.reject_unsupported(body.unsupported_params())
        payload = _as_sent(await _json(request) if payload is None else dict(payload), model)
        max_tokens, _ = body.requested_max_tokens()
        if turn is not None:
            history = await self._fitted_history(pool, model, turn, payload, max_tokens, body.truncation)
            payload["messages"] = [*history, *payload["messages"]]
        elif body.truncation == "auto":
            payload["truncation"] = "auto"  # the replica cuts the request's own earlier turns
        await self._screen(lambda: [m["content"] for m in new_messages], model, "messages")
        call = _Call(
            "/v1/chat/completions", "chatcmpl", "content", model, pool, key, payload, body.stream,
            *_usage_asked(body), choices=body.n, resumable=_resumable(body), turn=turn, turn_messages=new_messages,
            obfuscate=_obfuscation_asked(body), keeper=keeper, keeps_calls=turn is not None and bool(body.tools),
        )
        if self._limits_tokens(key):
            count, max_model_len = await self._count(pool, chat_tokenize_body(model, payload))
            call.prompt_tokens = count
            call.reserve_tokens = _reservation([count], max_tokens, body.n, max_model_len)
        return await self._run(request, call)

    async def completion(self, request: Request, body: CompletionRequest) -> Response:
        if KV_TRANSFER_PARAMS in await _json(request):
            return kv_transfer_params_refused()
        key = request_key(request.state)
        prompts = body.prompts()
        model, pool = await self.routed(body.model, key, key.id if key is not None else body.user,
                                        lambda: prompt_texts(prompts))
        errors.reject_unsupported(body.unsupported_params())
        payload = await _payload(request, model)
        if self.platform.safety is not None:
            texts = [p if isinstance(p, str) else await self._detokenize(pool, model, p) for p in prompts]
            await self._screen(lambda: texts, model, "prompt")
        call = _Call(
            "/v1/completions", "cmpl", "text", model, pool, key, payload, body.stream, *_usage_asked(body),
            choices=body.n * len(prompts), resumable=_resumable(body), obfuscate=_obfuscation_asked(body),
        )
        if self._limits_tokens(key):
            counts, max_model_len = await self._counts(pool, model, prompts)
            call.prompt_tokens = sum(counts)
            call.reserve_tokens = _reservation(counts, body.max_tokens, body.n, max_model_len)
        return await self._run(request, call)

    async def embeddings(self, request: Request, body: EmbeddingRequest) -> Response:
        inputs = body.inputs()
        return await self._pooled(request, _Pooled("/v1/embeddings", "embd", body.model, body.user, inputs,
                                                   body.truncate_prompt_tokens, [(inputs, "input")]))

    async def classify(self, request: Request, body: ClassificationRequest) -> Response:
        inputs = body.inputs()
        return await self._pooled(request, _Pooled("/classify", "classify", body.model, body.user, inputs,
                                                   body.truncate_prompt_tokens, [(inputs, "input")]))

    async def moderation(self, request: Request, body: ModerationRequest) -> Response:
        """Answered by the content filter here, or by a replica of the classifier's pool (the texts it judges
        unscreened), as platform/moderation.py chooses."""
        texts = body.texts()
        model = choose_moderator(body.model, self.router.names(), self.platform)
        if model == CONTENT_FILTER_MODEL:
            return await moderate_by_filter(self.platform, self.workers, request_key(request.state), texts)
        return await self._pooled(request, _Pooled("/v1/moderations", "modr", model, None, texts, None, []))

    async def score(self, request: Request, body: ScoreRequest) -> Response:
        return await self._pooled(request, _scored("/v1/score", "score", body))

    async def rerank(self, request: Request, body: RerankRequest) -> Response:
        return await self._pooled(request, _scored("/v1/rerank", "rerank", body))

    async def _pooled(self, request: Request, pooled: _Pooled) -> Response:
        """A request a replica answers from embeddings (embeddings, scores, rerank): screened, its prompt tokens
        counted and reserved, and metered with the usage the replica reports."""
        key = request_key(request.state)
        model, pool = self.resolve(pooled.model, key, key.id if key is not None else pooled.user)
        payload = await _payload(request, model)
        for texts, param in pooled.screened:
            await self._screen(lambda texts=texts: [item for item in texts if isinstance(item, str)], model, param)
        call = _Call(pooled.path, pooled.id_prefix, None, model, pool, key, payload, stream=False, include_usage=False,
                     continuous_usage=False, choices=0)
        if self._limits_tokens(key):
            counts, max_model_len = await self._counts(pool, model, pooled.inputs)
            call.prompt_tokens = call.reserve_tokens = sum(
                _truncated(count, pooled.truncate, max_model_len) for count in counts
            )
            if pooled.pairs is not None:
                # Which a pool's model is, an embedding model or a cross-encoder (reading the first text again
                # with each pair), is the replica's to know: the reservation takes the larger, each pair's two
                # texts (with their special tokens, at least the pair's own), settled to the usage reported.
                call.reserve_tokens = sum(_truncated(counts[a] + counts[b], pooled.truncate, max_model_len)
                                          for a, b in pooled.pairs)
        return await self._run(request, call)

    async def forward_tokenizer(self, request: Request, path: str) -> Response:
        """/tokenize and /detokenize, answered by a replica of the model's pool."""
        payload = await _json(request)
        if not isinstance(payload.get("model"), str | None):
            raise APIError(400, "`model` must be a string.", param="model", code="invalid_value")
        key = request_key(request.state)
        model, pool = self.resolve(payload.get("model"), key, key.id if key is not None else None)
        payload["model"] = model
        return await self.proxy.forward(pool, path, json.dumps(payload).encode(), "", _replica_headers(request))

    async def count_tokens(self, request: Request, prompt: dict[str, Any]) -> int:
        """A chat prompt's tokens (given as a /tokenize body: Anthropic's count_tokens, the Responses API's
        input_tokens), counted by a replica of the model's pool."""
        key = request_key(request.state)
        model, pool = self.resolve(prompt["model"], key, key.id if key is not None else None)
        count, _ = await self._count(pool, {**prompt, "model": model})
        return count

    def resolve(self, model: str | None, key: ApiKey | None, routing_key: str | None) -> tuple[str, Pool]:
        """The pool a request for `model` goes to: by name or alias (a canary alias picks one, the same
        for the same `routing_key`); unset means the first. 404 for an unknown one or one the key may not use."""
        name = model if model is not None else self.router.default_name()
        if key is not None and not key.allows_model(name):
            raise errors.model_not_found(name)
        try:
            return self.router.resolve(name, routing_key)
        except KeyError:
            raise errors.model_not_found(name) from None

    async def routed(
        self, model: str | None, key: ApiKey | None, routing_key: str | None, texts: Callable[[], Sequence[str]]
    ) -> tuple[str, Pool]:
        """`resolve`, where `model` may also name a content router: the key needs the router's name, and the
        request goes where the router sends it by `texts()`."""
        router = self.content_routers.get(model) if model is not None else None
        if router is None:
            return self.resolve(model, key, routing_key)
        if key is not None and not key.allows_model(router.name):
            raise errors.model_not_found(router.name)
        choice = await router.choose(texts())
        if self.platform.metrics is not None:
            self.platform.metrics.routed.labels(router.name, choice.model, choice.reason).inc()
        return self.router.resolve(choice.model, routing_key)

    async def embed_texts(self, model: str, texts: Sequence[str]) -> np.ndarray:
        """A content router's embeddings, one row per text, from a replica of `model`'s pool (each text cut to
        what the model embeds); neither limited nor metered, as the request they route is."""
        pool = self.router.handle(model)
        answer = await self._ask(pool, "/v1/embeddings", {"model": model, "input": list(texts),
                                                          "truncate_prompt_tokens": -1, "encoding_format": "base64"})
        rows = sorted(answer["data"], key=lambda row: row["index"])
        return np.stack([np.frombuffer(base64.b64decode(row["embedding"]), dtype=np.float32) for row in rows])

    # ---- before the replica -----------------------------------------------------------------------
    def _limits_tokens(self, key: ApiKey | None) -> bool:
        """Whether the key's requests need their tokens counted before they run (a TPM limit, a quota)."""
        if key is None:
            return False
        return (self.platform.limiter is not None and key.tpm is not None) or (
            self.platform.quotas is not None and key.token_quota is not None
        )

    async def _screen(self, texts: Callable[[], Sequence[str]], model: str, param: str) -> None:
        if self.platform.safety is not None:
            await self.workers.run(lambda: self.platform.check_prompt(model, texts(), param))

    async def _fitted_history(
        self, pool: Pool, model: str, turn: ConversationTurn, payload: dict[str, Any], max_tokens: int | None,
        truncation: str,
    ) -> list[dict[str, Any]]:
        """The stored history the turn continues (in OpenAI's form: its images as content parts); with
        `truncation: "auto"` its oldest turns are left out until it fits the context window (the server's
        `fit_history`, counting with /tokenize)."""
        history = wire_messages(turn.history)
        if truncation == "disabled" or not history:
            return history
        loop = asyncio.get_running_loop()
        _, max_model_len = await self._count(pool, chat_tokenize_body(model, payload))
        new_messages = payload["messages"]

        def render(messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
            body = chat_tokenize_body(model, {**payload, "messages": messages})
            count, _ = asyncio.run_coroutine_threadsafe(self._count(pool, body), loop).result()
            return "", [0] * count  # fit_history weighs the prompt by its length only

        _, _, dropped = await self.workers.run(
            fit_history, render, history, new_messages, max_model_len - (max_tokens or 1), "auto"
        )
        turn.truncated = dropped
        system = 0
        while system < len(history) and history[system]["role"] == "system":
            system += 1
        return history[:system] + history[system + dropped:]

    async def _count(self, pool: Pool, body: dict[str, Any]) -> tuple[int, int]:
        """The prompt's token count and the model's context window, from a replica's /tokenize."""
        answer = await self._ask(pool, "/tokenize", body)
        return int(answer["count"]), int(answer["max_model_len"])

    async def _counts(
        self, pool: Pool, model: str, prompts: Sequence[str | list[int]]
    ) -> tuple[list[int], int]:
        """Each prompt's token count (the texts counted by one /tokenize call), and the context window."""
        texts = [p for p in prompts if isinstance(p, str)]
        answer = await self._ask(pool, "/tokenize", {"model": model, "prompt": texts})
        text_counts = iter(answer["counts"])
        counts = [next(text_counts) if isinstance(p, str) else len(p) for p in prompts]
        return counts, int(answer["max_model_len"])

    async def _detokenize(self, pool: Pool, model: str, tokens: list[int]) -> str:
        return str((await self._ask(pool, "/detokenize", {"model": model, "tokens": tokens}))["prompt"])

    async def _ask(self, pool: Pool, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.proxy.forward(pool, path, json.dumps(body).encode(), "", JSON_HEADERS)
        try:
            answer = json.loads(bytes(response.body))
        except ValueError:
            raise APIError(502, f"A replica's {path} answer is not JSON.", code="replica_failed") from None
        if response.status_code != 200:
            raise _replica_error(response.status_code, answer, response.headers)
        return answer

    # ---- the replica and after ----------------------------------------------------------------------
    async def _run(self, request: Request, call: _Call) -> Response:
        requested = call.payload.get("priority", 0)
        if (priority := self.platform.priority_of(call.key, requested)) != requested:
            call.payload["priority"] = priority  # the key's tier's, for replicas run with --scheduling-policy priority
        admission = await self.platform.admit(call.key, call.model, call.reserve_tokens)
        started = time.monotonic()
        response_id = random_id(call.id_prefix)
        headers = {**admission.headers, **(call.turn.headers() if call.turn is not None else {})}
        relays: list[StreamRelay] = []  # the stream's, once the proxy hands it over
        replica_headers = _replica_headers(request)
        whole = None  # a non-streamed chat or completion: read whole from the replica's events (whole.py)
        if not call.stream and call.text_field is not None:
            whole = WholeForwarding(lambda: self._meter(call, response_id, admission, started))
            replica_headers[PROGRESS_HEADER] = "1"

        def relay() -> GuardedStream | WholeReply:
            if whole is not None:
                return whole.reply()
            meter = self._meter(call, response_id, admission, started)
            made = StreamRelay(
                meter, self._reply(call), response_id, include_usage=call.include_usage,
                continuous_usage=call.continuous_usage, on_completed=lambda reply: self._completed(call, meter, reply),
                obfuscate=call.obfuscate,
            )
            relays.append(made)
            return GuardedStream(made, self.cutoff)

        def forward() -> Awaitable[Response]:
            return self.proxy.forward(call.pool, call.path, body, prompt_key(call.payload), replica_headers, relay,
                                      cache_key=prompt_cache_key(call.payload), payload=call.payload)

        if call.stream:
            call.payload["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        body = json.dumps(call.payload).encode()
        try:
            if call.stream:
                response = await forward()
            else:
                response = await until_disconnect(request, whole.run(forward) if whole is not None else forward())
        except ClientDisconnected:  # a non-streamed request the client left: metered with what the replica reported
            meter = whole.meter if whole is not None else None
            (meter or self._meter(call, response_id, admission, started)).finish(UsageStatus.DISCONNECTED)
            raise
        except BaseException:
            if whole is not None and whole.meter is not None:
                whole.meter.finish(UsageStatus.ERROR)
            else:
                admission.release()
            raise
        if relays and call.resumable:
            owner = call.key.id if call.key is not None else None
            return resumable_response(self.streams, response_id, owner, response, headers)
        if relays:
            response.headers.update(headers)
            return response
        if whole is not None and whole.meter is not None:
            return await self._reply_progressed(call, whole, response, response_id, headers)
        if response.status_code != 200:
            _give_back(admission, response.status_code)
            return response
        if call.text_field is None:
            return await self._reply_as_written(call, response, response_id, admission, started, headers)
        meter = self._meter(call, response_id, admission, started)
        return await self._reply_whole(call, json.loads(bytes(response.body)), meter, response_id, headers)

    async def _reply_progressed(
        self, call: _Call, whole: WholeForwarding, response: Response, response_id: str, headers: dict[str, str]
    ) -> Response:
        """A non-streamed reply the replica sent as events. One that broke off mid-way (its last event an
        error), or whose retry no replica took (`response`, the proxy's error), is metered with the usage
        reported last: a 502, or the proxy's error."""
        meter = whole.meter
        assert meter is not None
        if not isinstance(response, StreamingResponse):
            await meter.finish_durably(UsageStatus.ERROR)
            return response
        data = whole.replies[-1].data
        if data is None or "error" in data:
            await meter.finish_durably(UsageStatus.ERROR)
            return JSONResponse(data or error_body(502, "The replica's reply ended early.", code="replica_failed"),
                                status_code=502)
        return await self._reply_whole(call, data, meter, response_id, headers)

    async def _reply_whole(
        self, call: _Call, data: dict[str, Any], meter: RelayMeter, response_id: str, headers: dict[str, str]
    ) -> Response:
        """A non-streamed reply: its output screened, metered with its usage, stored in the conversation."""
        meter.observe_usage(data.get("usage") or {})
        data["id"] = response_id
        reply = self._reply(call)
        for choice in data.get("choices") or ():
            reply.screen(choice, final=True)
        await meter.finish_durably(CONTENT_FILTER if reply.blocked else UsageStatus.COMPLETED)
        await self._completed(call, meter, reply, data)
        return JSONResponse(data, headers=headers)

    async def _reply_as_written(
        self, call: _Call, response: Response, response_id: str, admission: Admission, started: float,
        headers: dict[str, str],
    ) -> Response:
        """A reply without choices (embeddings): passed on as the replica wrote it, metered with its usage
        (read on a worker thread: the body grows with the inputs)."""
        reported = await self.workers.run(_USAGE.decode, bytes(response.body))
        meter = self._meter(call, response_id, admission, started)
        meter.observe_usage(reported.usage)
        await meter.finish_durably(UsageStatus.COMPLETED)
        return Response(response.body, status_code=200, media_type="application/json", headers=headers)

    def _meter(self, call: _Call, response_id: str, admission: Admission, started: float) -> RelayMeter:
        meter = RelayMeter(self.platform, response_id, call.key, call.model, admission, call.prompt_tokens)
        meter.started = started
        return meter

    def _reply(self, call: _Call) -> Reply:
        assert call.text_field is not None
        fold = ChatFold() if (call.keeper is not None or call.keeps_calls) and call.stream else None
        return Reply(call.text_field, call.choices, self._output_guard, fold)

    def _output_guard(self) -> OutputGuard | None:
        safety = self.platform.safety
        return OutputGuard(safety, self.platform.holdback_chars) if safety is not None else None

    async def _completed(self, call: _Call, meter: RelayMeter, reply: Reply, whole: dict[str, Any] | None = None) -> None:
        """After a request ran to its end: its blocked outputs counted, its reply stored in the conversation, the
        completion kept when it asked to be stored (`whole`: a non-streamed one's, as answered; a streamed one's
        is folded from its chunks)."""
        self.platform.count_blocked_outputs(call.model, meter.request_id, reply.blocked)
        if whole is None and reply.fold is not None:
            whole = reply.fold.completion(meter.usage())
        if call.turn is not None:
            calls = _first_choice(whole)["message"].get("tool_calls") if call.keeps_calls and whole else None
            message = reply_message(reply.first_text, calls, reply.first_reasoning)
            await call.turn.save(call.turn_messages, message, meter.completion_tokens)
        if call.keeper is not None:
            assert whole is not None
            await call.keeper.save(whole)


def _first_choice(completion: dict[str, Any]) -> dict[str, Any]:
    return next(choice for choice in completion["choices"] if choice["index"] == 0)


class _ReportedUsage(msgspec.Struct):
    usage: dict[str, Any] = msgspec.field(default_factory=dict)


_USAGE = msgspec.json.Decoder(_ReportedUsage)


async def _json(request: Request) -> dict[str, Any]:
    try:
        payload = await request.json()  # parsed once: a validated body was read through this request already
    except ValueError:
        raise APIError(400, "The request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    return payload


async def _payload(request: Request, model: str) -> dict[str, Any]:
    """The request's body as the replica gets it."""
    return _as_sent(await _json(request), model)


def _as_sent(payload: dict[str, Any], model: str) -> dict[str, Any]:
    """A body as the replica gets it: the concrete model, without the platform's fields."""
    payload["model"] = model
    for name in PLATFORM_FIELDS:
        payload.pop(name, None)
    return payload


def _resumable(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return body.stream and body.stream_options is not None and body.stream_options.resumable


def _obfuscation_asked(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_obfuscation


def _usage_asked(body: ChatCompletionRequest | CompletionRequest) -> tuple[bool, bool]:
    options = body.stream_options
    return (options.include_usage, options.continuous_usage_stats) if options is not None else (False, False)


def _truncated(count: int, truncate: int | None, max_model_len: int) -> int:
    """An embeddings input's token count cut to `truncate_prompt_tokens` (-1: to the context window,
    which may be more than the model embeds: the reservation is settled to the usage the replica reports)."""
    if truncate is None:
        return count
    return min(count, max_model_len if truncate == -1 else truncate)


def _reservation(prompt_counts: Sequence[int], max_tokens: int | None, n: int, max_model_len: int) -> int:
    """What `llmserve serve` reserves: each prompt plus n completion budgets (max_tokens, or what the
    context window leaves)."""
    return sum(count + n * (max_tokens if max_tokens is not None else max(max_model_len - count, 0))
               for count in prompt_counts)


def _give_back(admission: Admission, status: int) -> None:
    """A request the replica refused (a 4xx: invalid, as the server finds before it admits a request)
    counts against no limit; one that failed (no replica could take it) keeps its request counted."""
    if 400 <= status < 500:
        admission.withdraw()
    else:
        admission.release()


def _replica_headers(request: Request) -> dict[str, str]:
    """The client's headers for the replica, less its key (the replicas run without a platform)."""
    return {k: v for k, v in forwarded_headers(request.headers).items() if k.lower() != "authorization"}


def _replica_error(status: int, answer: Any, headers: Mapping[str, str]) -> APIError:
    error = answer.get("error") if isinstance(answer, dict) else None
    if not isinstance(error, dict):
        return APIError(502, f"A replica answered {status}.", code="replica_failed")
    retry = {"Retry-After": headers["retry-after"]} if "retry-after" in headers else None
    return APIError(status, str(error.get("message")), param=error.get("param"), code=error.get("code"),
                    type=error.get("type"), headers=retry)
