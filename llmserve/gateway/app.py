"""The gateway's HTTP app: the OpenAI endpoints (/v1/chat/completions, /v1/completions, /v1/embeddings,
/v1/responses, scores, rerank, /classify and /v1/moderations) forwarded to the pool named by the body's `model` (or
an alias of it; with a platform, a moderation its content filter judges is answered here), `/v1/models` (the pools and aliases), /tokenize and /detokenize (answered by a replica), `/health` and
`/metrics`. With a platform (platform.py), the keys, rate limits, usage, conversations and safety of
`llmserve serve` around it all, and `/v1/usage`, `/v1/conversations` and stored responses served from the
platform's store; without one, requests are passed through as they are, and a stored response is read from
the replica that knows it. A pool with prefill replicas disaggregates long prompts (disaggregation.py); the
`kv_transfer_params` that does it are the gateway's own, a client's are a 400."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmserve.gateway import errors
from llmserve.gateway.client import ReplicaClient
from llmserve.gateway.disaggregation import (
    KV_TRANSFER_PARAMS,
    DisaggregationOptions,
    Disaggregator,
    prefill_pool_name,
)
from llmserve.gateway.discovery import Discovery, Resolver, resolve_host
from llmserve.gateway.lane import LaneApp, ProxyLane
from llmserve.gateway.metrics import GatewayMetrics
from llmserve.gateway.platform import GatewayPlatform
from llmserve.gateway.pool import HealthChecker, Pool
from llmserve.gateway.proxy import (
    FIRST_BYTE_TIMEOUT_S,
    HOP_HEADERS,
    STREAM_IDLE_TIMEOUT_S,
    Proxy,
    forwarded_headers,
    prompt_cache_key,
    prompt_key,
)
from llmserve.gateway.routing import policy_by_name
from llmserve.platform.content_routing import ContentRouter, ContentRouterConfig
from llmserve.platform.routing import ModelRouter
from llmserve.server import (
    anthropic_api,
    anthropic_batches,
    batches,
    conversations,
    responses_api,
    stored_completions,
    stored_responses,
    streams,
    usage,
)
from llmserve.server.anthropic_api import CountTokensRequest, MessagesRequest
from llmserve.server.anthropic_errors import AnthropicErrorMiddleware
from llmserve.server.batch_runner import start_batch_runner, stop_batch_runner
from llmserve.server.cors import install_cors
from llmserve.server.errors import install_error_handlers
from llmserve.server.gateway import AuthMiddleware, Platform, public_paths, request_key
from llmserve.server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES, BodySizeLimitMiddleware, upload_limits
from llmserve.server.metrics import PlatformMetrics
from llmserve.server.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    EmbeddingRequest,
    ModelCard,
    ModelList,
    ModerationRequest,
    RerankRequest,
    ScoreRequest,
)
from llmserve.server.responses_protocol import InputTokensRequest, ResponsesRequest
from llmserve.server.shared_streams import stream_registry
from llmserve.server.streaming import ResumeLimits
from llmserve.server.workers import WorkerPool
from llmserve.web import install_page, page_paths

# Passed on as they are by a gateway without its platform (with it, each has a route; a Responses API request
# runs there as a chat completion, metered and screened as one).
PROXIED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
                 "/v1/responses/input_tokens", "/v1/score",
                 "/score", "/v1/rerank", "/rerank", "/v2/rerank", "/classify", "/v1/moderations", "/v1/messages",
                 "/v1/messages/count_tokens")


@dataclass(frozen=True)
class ReplicaOptions:
    """How the gateway watches its replicas and waits for them (see pool.py, proxy.py, discovery.py)."""

    health_interval_s: float = 0.5
    health_timeout_s: float = 0.5
    first_byte_timeout_s: float = FIRST_BYTE_TIMEOUT_S
    stream_idle_timeout_s: float = STREAM_IDLE_TIMEOUT_S
    resolve_interval_s: float = 5.0
    resolver: Resolver = resolve_host


class GatewayState:
    def __init__(
        self, pools: Mapping[str, Sequence[str]], policy: str, options: ReplicaOptions, *,
        aliases: Mapping[str, Sequence[tuple[str, float]]], prefill_pools: Mapping[str, Sequence[str]],
        disaggregation: DisaggregationOptions,
    ) -> None:
        self.pools = {name: Pool.of(name, urls, policy_by_name(policy)) for name, urls in pools.items()}
        # A pool's prefill replicas, routed as the pool is: a prefill replica keeps what it computed in its
        # prefix cache too, so prompts that start alike (a system prompt) go where it is cached.
        self.prefill_pools = {name: Pool.of(prefill_pool_name(name), urls, policy_by_name(policy))
                              for name, urls in prefill_pools.items()}
        self.router: ModelRouter[Pool] = ModelRouter()
        for name, pool in self.pools.items():
            self.router.add_model(name, pool)
        for alias, targets in aliases.items():
            self.router.add_alias(alias, list(targets))
        watched = [*self.pools.values(), *self.prefill_pools.values()]
        self.metrics = GatewayMetrics(watched)
        self.client = ReplicaClient()
        disaggregator = (Disaggregator(self.prefill_pools, self.client, self.metrics, disaggregation)
                         if self.prefill_pools else None)
        self.proxy = Proxy(self.client, self.metrics, first_byte_timeout_s=options.first_byte_timeout_s,
                           stream_idle_timeout_s=options.stream_idle_timeout_s, disaggregator=disaggregator)
        self.health = HealthChecker(
            watched, self.client, interval_s=options.health_interval_s, timeout_s=options.health_timeout_s,
        )
        self.discovery = Discovery(watched, resolver=options.resolver, interval_s=options.resolve_interval_s)
        for pool in watched:
            pool.on_eject = lambda pool, replica: self.metrics.ejections.labels(pool.name, replica.url).inc()
            pool.on_change = lambda pool: self.health.sync()
        self.created = int(time.time())

    async def start(self) -> None:
        """Resolve the pools' dns+ entries and check every replica once, then keep doing both."""
        await self.client.start()
        await self.discovery.resolve_all()
        await self.health.check_all()
        self.health.start()
        self.discovery.start()

    async def stop(self) -> None:
        await self.discovery.stop()
        await self.health.stop()
        await self.client.aclose()


def _content_router(front: GatewayPlatform, name: str, config: ContentRouterConfig) -> ContentRouter:
    """A router answering to `name` (an alias of its default for whatever it does not route), embedding with a
    replica of its embedding model's pool."""
    unknown = [model for model in config.models() if model not in front.router.model_names()]
    if unknown:
        raise ValueError(f"Router {name!r} names {unknown[0]!r}, which is not a pool.")
    front.router.add_alias(name, config.default)
    return ContentRouter(name, config, partial(front.embed_texts, config.embedding_model))


def build_gateway_app(
    pools: Mapping[str, Sequence[str]], policy: str = "prefix", options: ReplicaOptions | None = None, *,
    platform: Platform | None = None, aliases: Mapping[str, Sequence[tuple[str, float]]] | None = None,
    content_routers: Mapping[str, ContentRouterConfig] | None = None, public_metrics: bool = False, public_openapi: bool = False, allowed_origins: Sequence[str] = (),
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES, stream_resume: ResumeLimits | None = None,
    api_key: str | None = None, prefill_pools: Mapping[str, Sequence[str]] | None = None,
    disaggregation: DisaggregationOptions | None = None, shared_streams_url: str | None = None,
) -> FastAPI:
    """The gateway over `pools` (model name -> replica base URLs, e.g. http://10.0.0.5:8000, or
    `dns+http://name:port` for every address the name resolves to), answering to `aliases` too
    (alias -> [(pool, weight)], a canary when several). `platform` puts the platform services in front
    (once keys exist, every path but /health needs one, /metrics too unless `public_metrics`); None
    passes requests through as they are. `public_openapi`, `allowed_origins` (CORS), `stream_resume` (the
    bounds of the resumable streams it relays), `shared_streams_url` (the Redis where they are shared with other
    gateways) and `api_key` (one more key, given at start) as `llmserve serve`'s.
    `prefill_pools` (pool name -> its prefill replicas' URLs, as `pools`') disaggregates the long prompts of
    those pools, by `disaggregation`'s rule (disaggregation.py)."""
    if not pools or any(not urls for urls in pools.values()):
        raise ValueError("The gateway needs at least one pool, each with at least one replica URL.")
    for name, urls in (prefill_pools or {}).items():
        if name not in pools:
            raise ValueError(f"Prefill pool {name!r} is not a pool: its decode replicas are the pool of that name.")
        if not urls:
            raise ValueError(f"Prefill pool {name!r} has no replica URL.")
    if content_routers and platform is None:
        raise ValueError("Content routers run in the gateway's platform: without it requests pass through by pool.")
    state = GatewayState(pools, policy, options or ReplicaOptions(), aliases=aliases or {},
                         prefill_pools=prefill_pools or {}, disaggregation=disaggregation or DisaggregationOptions())
    workers = WorkerPool()
    if platform is not None:
        platform.metrics = PlatformMetrics(state.metrics.registry)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        background = []
        if platform is not None:
            await platform.check_limiter()
            background.append(asyncio.create_task(platform.purge_expired()))
        batch_runner = start_batch_runner(app, platform)
        try:
            yield
        finally:
            await stop_batch_runner(batch_runner)
            for task in background:
                task.cancel()
            await front.streams.close()
            if platform is not None:
                await platform.aclose()
            workers.shutdown()
            await state.stop()

    app = LaneApp(title="llmserve gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = state
    app.state.platform = platform
    install_error_handlers(app)
    max_file_bytes = platform.batches.files.max_bytes if platform is not None and platform.batches else None
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes,
                       path_limits=upload_limits(max_file_bytes))
    keys = platform.keys if platform is not None else None
    if keys is not None or api_key:
        public = public_paths(app, public_metrics, public_openapi) | page_paths()
        app.add_middleware(AuthMiddleware, keys=keys, metrics=platform.metrics if platform is not None else None,
                           public_paths=public, api_key=api_key)
    app.add_middleware(AnthropicErrorMiddleware)
    install_cors(app, allowed_origins)
    front = GatewayPlatform(platform or Platform(), state.router, state.proxy, workers,
                           stream_registry(stream_resume, shared_streams_url, state.metrics.registry))
    for name, config in (content_routers or {}).items():
        front.content_routers[name] = _content_router(front, name, config)
    app.state.streams = front.streams  # resumed by /v1/streams/{id} (gateway/resume.py)
    app.state.end_streams = front.end_streams  # past the shutdown timeout (gateway/shutdown.py)

    def forwarder(path: str) -> Callable[[bytes, dict[str, str]], Awaitable[Response]]:
        async def forward(body: bytes, headers: dict[str, str]) -> Response:
            try:
                payload = json.loads(body)
            except (ValueError, RecursionError):  # nested past the parser's depth: not JSON it can read
                return errors.error_response(400, "The request body is not valid JSON.", code="invalid_json")
            model = payload.get("model") if isinstance(payload, dict) else None
            if not isinstance(model, str):
                return errors.error_response(400, "`model` is required (a string).", param="model",
                                             code="missing_model")
            if KV_TRANSFER_PARAMS in payload:
                return errors.kv_transfer_params_refused()
            pool = state.pools.get(model)
            if pool is None:
                return errors.model_not_found(model)
            options = payload.get("stream_options")
            if isinstance(options, dict) and options.pop("resumable", None) is not None:
                # Without a platform the gateway relays the replica's events untouched and buffers none
                # (resume.py buffers the platform's relay), so a stream stays plain: its generation
                # stops when its client leaves.
                body = json.dumps(payload).encode()
            return await state.proxy.forward(pool, path, body, prompt_key(payload), headers,
                                             cache_key=prompt_cache_key(payload), payload=payload)

        return forward

    async def stored_response(request: Request) -> Response:
        """Without a platform the replicas keep the responses they made (and run those made in background): the
        first pool whose replica knows the id answers (replicas that share a database, `--database-url`, all do). A
        pool that could not answer (a 5xx) is passed over too, but its answer wins over the others' 404s: the id may
        be its replicas'."""
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        failed: Response | None = None
        for pool in dict.fromkeys(state.pools.values()):
            reply = await state.proxy.forward(pool, path, b"", "", forwarded_headers(request.headers),
                                              method=request.method)
            if reply.status_code != 404 and reply.status_code < 500:
                return reply
            if reply.status_code >= 500 and failed is None:
                failed = reply
        return failed or errors.error_response(
            404, f"Response with id '{request.path_params['response_id']}' not found.", code="response_not_found")

    if platform is None:  # the bodies are passed on as they are: they take the lane, past FastAPI
        app.lane = ProxyLane({path: forwarder(path) for path in PROXIED_PATHS}, max_request_body_bytes, HOP_HEADERS)
        if api_key:
            app.lane_entry = AnthropicErrorMiddleware(AuthMiddleware(app.lane, keys=None, api_key=api_key))
        app.add_api_route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"],
                          response_model=None)
        app.add_api_route("/v1/responses/{response_id}/input_items", stored_response, methods=["GET"],
                          response_model=None)
        app.add_api_route("/v1/responses/{response_id}/cancel", stored_response, methods=["POST"],
                          response_model=None)
    else:
        @app.post("/v1/chat/completions", response_model=None)
        async def chat_completions_with_platform(body: ChatCompletionRequest, request: Request) -> Response:
            return await front.chat(request, body)

        @app.post("/v1/completions", response_model=None)
        async def completions_with_platform(body: CompletionRequest, request: Request) -> Response:
            return await front.completion(request, body)

        @app.post("/v1/embeddings", response_model=None)
        async def embeddings_with_platform(body: EmbeddingRequest, request: Request) -> Response:
            return await front.embeddings(request, body)

        @app.post("/v1/score", response_model=None)
        @app.post("/score", response_model=None, include_in_schema=False)
        async def score_with_platform(body: ScoreRequest, request: Request) -> Response:
            return await front.score(request, body)

        @app.post("/v1/rerank", response_model=None)
        @app.post("/rerank", response_model=None, include_in_schema=False)
        @app.post("/v2/rerank", response_model=None, include_in_schema=False)
        async def rerank_with_platform(body: RerankRequest, request: Request) -> Response:
            return await front.rerank(request, body)

        @app.post("/classify", response_model=None)
        async def classify_with_platform(body: ClassificationRequest, request: Request) -> Response:
            return await front.classify(request, body)

        @app.post("/v1/messages", response_model=None)
        async def messages_with_platform(body: MessagesRequest, request: Request) -> Response:
            return await anthropic_api.answer(body, lambda chat, payload: front.chat(request, chat, payload))

        @app.post("/v1/messages/count_tokens", response_model=None)
        async def count_message_tokens_with_platform(body: CountTokensRequest, request: Request) -> Response:
            return JSONResponse({"input_tokens": await front.count_tokens(request, anthropic_api.count_request(body))})

        @app.post("/v1/moderations", response_model=None)
        async def moderations_with_platform(body: ModerationRequest, request: Request) -> Response:
            return await front.moderation(request, body)

        @app.post("/v1/responses", response_model=None)
        async def responses_with_platform(body: ResponsesRequest, request: Request) -> Response:
            chat_request = responses_api.detached(request) if body.background else request
            return await responses_api.answer(body, lambda chat, payload: front.chat(chat_request, chat, payload),
                                              stored_responses.storage_for(request))

        @app.post("/v1/responses/input_tokens", response_model=None)
        async def count_input_tokens_with_platform(body: InputTokensRequest, request: Request) -> Response:
            prompt = await responses_api.input_token_request(body, stored_responses.storage_for(request))
            count = await front.count_tokens(request, prompt)
            return JSONResponse({"object": "response.input_tokens", "input_tokens": count})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await front.forward_tokenizer(request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await front.forward_tokenizer(request, "/detokenize")

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        key = request_key(request.state)
        names = [n for n in state.router.ready_names() if key is None or key.allows_model(n)]
        return JSONResponse(ModelList(data=[_card(n) for n in names]).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> JSONResponse:
        name, _ = front.resolve(model_id, request_key(request.state), None)
        return JSONResponse(_card(model_id, name).model_dump())

    def _card(name: str, pool: str | None = None) -> ModelCard:
        return ModelCard(id=name, created=state.created, root=pool if pool not in (None, name) else None)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    for module in (usage, conversations, streams,
                   *((stored_responses, stored_completions, batches, anthropic_batches) if platform is not None else ())):
        app.include_router(module.router)
    install_page(app)
    return app
