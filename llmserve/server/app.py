"""The FastAPI application: routers, OpenAI-shaped error handling, and draining on shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

import llmserve
from llmserve.engine.async_llm import AsyncLLM
from llmserve.platform.content_routing import ContentRouter, ContentRouterConfig
from llmserve.platform.routing import ModelRouter
from llmserve.server import (
    admin,
    anthropic,
    anthropic_batches,
    batches,
    chat,
    classify,
    completions,
    conversations,
    embeddings,
    health,
    lora,
    metrics,
    moderations,
    responses,
    scores,
    stored_completions,
    stored_responses,
    streams,
    tokens,
    usage,
)
from llmserve.server import models as models_api
from llmserve.server.anthropic_errors import AnthropicErrorMiddleware
from llmserve.server.batch_runner import start_batch_runner, stop_batch_runner
from llmserve.server.cors import install_cors
from llmserve.server.embeddings import embed_texts
from llmserve.server.errors import install_error_handlers, shutting_down
from llmserve.server.gateway import AuthMiddleware, Platform, public_paths
from llmserve.server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES, BodySizeLimitMiddleware, upload_limits
from llmserve.server.metrics import ServerMetrics
from llmserve.server.openapi import install_openapi
from llmserve.server.shared_streams import stream_registry
from llmserve.server.slo import SLO
from llmserve.server.state import ModelEndpoint, ServerState, base_endpoints
from llmserve.server.streaming import ResumeLimits
from llmserve.web import install_page, page_paths

logger = logging.getLogger(__name__)

TELEMETRY_DRAIN_SECONDS = 1.0

# Paths still answered while draining (monitoring keeps working until the process exits).
_ALWAYS_SERVED = ("/metrics",)

class DrainMiddleware:
    """Once the server is draining (SIGTERM), every new HTTP request gets a 503 with Retry-After."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.state.draining and scope["path"] not in _ALWAYS_SERVED:
            await shutting_down().response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


@dataclass
class ModelSpec:
    """A model to serve: a running engine, or a `load` function run in a thread after the server starts
    (requests for it get a 503 with Retry-After until it is ready)."""

    name: str
    engine: AsyncLLM | None = None
    load: Callable[[], AsyncLLM] | None = None
    root: str | None = None
    max_waiting_requests: int = 1024
    tool_call_parser: str | None = None  # None: the model family's format
    reasoning_parser: str | None = None


def _lifespan(state: ServerState, specs: Sequence[ModelSpec], slo: SLO, owns_engine: bool, shutdown_timeout: float):
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        drainer = asyncio.create_task(_drain_telemetry(state))
        loaders = [asyncio.create_task(_load(state, spec, slo)) for spec in specs if spec.engine is None]
        platform = state.platform
        if platform is not None:
            await platform.check_limiter()
            loaders.append(asyncio.create_task(platform.purge_expired()))
        batch_runner = start_batch_runner(app, platform)
        yield
        await stop_batch_runner(batch_runner)
        drainer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await drainer
        state.draining = True
        await state.streams.close()
        state.workers.shutdown()
        for loader in loaders:
            loader.cancel()
        if owns_engine:
            await asyncio.gather(*(e.engine.shutdown(shutdown_timeout) for e in state.endpoints()))
        if state.platform is not None:
            await state.platform.aclose()

    return lifespan


async def _load(state: ServerState, spec: ModelSpec, slo: SLO) -> None:
    assert spec.load is not None
    engine = None
    try:
        engine = await asyncio.to_thread(spec.load)
        endpoint = _endpoint(state, spec, engine, slo)
        _add_adapters(state.router, await asyncio.to_thread(lora.configured_adapters, endpoint))
    except Exception as exc:
        logger.exception("could not load model %s", spec.name)
        state.router.set_failed(spec.name, exc)
        if engine is not None:  # its LoRA adapters failed
            await engine.shutdown()
    else:
        state.router.set_ready(spec.name, endpoint)
        logger.info("model %s is ready", spec.name)
    state.model_settled()


def _add_adapters(router: ModelRouter[ModelEndpoint], adapters: list[ModelEndpoint]) -> None:
    for adapter in adapters:
        router.add_model(adapter.name, adapter)


def _endpoint(state: ServerState, spec: ModelSpec, engine: AsyncLLM, slo: SLO) -> ModelEndpoint:
    endpoint = ModelEndpoint(
        spec.name, engine, spec.root, spec.max_waiting_requests,
        tool_call_parser=spec.tool_call_parser, reasoning_parser=spec.reasoning_parser,
    )
    endpoint.telemetry = metrics.make_telemetry(engine, state.metrics, spec.name, slo)
    return endpoint


async def _drain_telemetry(state: ServerState) -> None:
    """Keep the engine event queues short even when nobody scrapes /metrics."""
    while True:
        await asyncio.sleep(TELEMETRY_DRAIN_SECONDS)
        state.metrics.drain()


def _content_router(state: ServerState, name: str, config: ContentRouterConfig) -> ContentRouter:
    """A router answering to `name` (an alias of its default for whatever it does not route), embedding with
    the server's own engine."""
    unknown = [model for model in config.models() if model not in state.router.model_names()]
    if unknown:
        raise ValueError(f"Router {name!r} names {unknown[0]!r}, which is not a served model.")
    state.router.add_alias(name, config.default)
    return ContentRouter(name, config, partial(embed_texts, state, config.embedding_model))


def build_app(
    engine_client: AsyncLLM | None = None,
    served_model_name: str | None = None,
    *,
    models: Sequence[ModelSpec] = (),
    aliases: Mapping[str, Sequence[tuple[str, float]]] | None = None,
    content_routers: Mapping[str, ContentRouterConfig] | None = None,
    model_aliases: Sequence[str] = (),
    unlisted_aliases: Collection[str] = (),
    model_root: str | None = None,
    max_waiting_requests: int = 1024,
    owns_engine: bool = False,
    shutdown_timeout: float = 30.0,
    slo: SLO | None = None,
    platform: Platform | None = None,
    public_metrics: bool = False,
    public_openapi: bool = False,
    allowed_origins: Sequence[str] = (),
    allowed_media_domains: Sequence[str] = (),
    trust_request_chat_template: bool = False,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    stream_resume: ResumeLimits | None = None,
    shared_streams_url: str | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """An OpenAI-compatible app over one engine (`engine_client` served as `served_model_name`, also
    answering to `model_aliases`) or several (`models`, routed by name and `aliases`).

    With `owns_engine`, the app's shutdown (after the HTTP server drained) stops the engines, giving
    what still runs `shutdown_timeout` seconds; otherwise the caller closes them. `platform` adds API
    keys, rate limits, usage metering, conversations and safety filters; once keys exist, every path
    but /health needs one, and /metrics and the OpenAPI document too unless `public_metrics` or
    `public_openapi`. `unlisted_aliases` (among `aliases`) are answered but not listed in /v1/models.
    `content_routers` are names whose chat and completion requests go to the model their text is most like
    (platform/content_routing.py); anything else sent to one goes to its default.
    The chat page at `/` (llmserve/web) is public: it asks for a key itself. `allowed_origins` turns
    on CORS for those origins ("*": any). A body over `max_request_body_bytes` gets a 413 before
    anything reads it. `tool_call_parser` and `reasoning_parser` name the formats
    `engine_client`'s replies are parsed in (a spec in `models` names its own). `stream_resume` bounds
    the buffers of resumable streams (server/streams.py), shared through the Redis at `shared_streams_url` with
    the other processes using it (server/shared_streams.py). `allowed_media_domains`: the hosts whose image URLs
    are fetched (none given: any; "none": no host). `trust_request_chat_template`: a chat request may bring its own
    chat template (server/templates.py).
    """
    specs = list(models)
    if engine_client is not None:
        name = served_model_name or "default"
        specs.insert(0, ModelSpec(
            name, engine_client, root=model_root, max_waiting_requests=max_waiting_requests,
            tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
        ))
    if not specs:
        raise ValueError("build_app needs an engine or at least one model spec.")
    slo = slo or SLO()
    router: ModelRouter[ModelEndpoint] = ModelRouter()
    server_metrics = ServerMetrics(lambda: base_endpoints(router))
    state = ServerState(
        router=router, metrics=server_metrics, platform=platform,
        streams=stream_registry(stream_resume, shared_streams_url, server_metrics.registry),
        allowed_media_domains=frozenset(allowed_media_domains),
        trust_request_chat_template=trust_request_chat_template,
    )
    if platform is not None:
        platform.metrics = state.metrics.platform
    for spec in specs:
        if spec.engine is not None:
            endpoint = _endpoint(state, spec, spec.engine, slo)
            router.add_model(spec.name, endpoint)
            _add_adapters(router, lora.configured_adapters(endpoint))
        else:
            router.add_loading(spec.name)
    for alias in model_aliases:
        if alias != specs[0].name and alias not in router.names():
            router.add_alias(alias, [(specs[0].name, 1.0)])
    for alias, targets in (aliases or {}).items():
        router.add_alias(alias, list(targets), listed=alias not in unlisted_aliases)
    for name, config in (content_routers or {}).items():
        state.content_routers[name] = _content_router(state, name, config)
    app = FastAPI(
        title="llmserve",
        version=llmserve.__version__,
        lifespan=_lifespan(state, specs, slo, owns_engine, shutdown_timeout),
        docs_url=None,
        redoc_url=None,
    )
    app.state.llmserve = state
    app.state.streams = state.streams  # what /v1/streams/{id} resumes (server/streams.py)
    app.state.platform = platform
    install_error_handlers(app)
    install_openapi(app)
    max_file_bytes = platform.batches.files.max_bytes if platform is not None and platform.batches else None
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_request_body_bytes,
                       path_limits=upload_limits(max_file_bytes))
    keys = platform.keys if platform is not None else None
    if keys is not None or api_key:
        public = public_paths(app, public_metrics, public_openapi) | page_paths()
        app.add_middleware(AuthMiddleware, keys=keys, metrics=state.metrics.platform, public_paths=public,
                           api_key=api_key)
    app.add_middleware(DrainMiddleware, state=state)
    app.add_middleware(AnthropicErrorMiddleware)
    install_cors(app, allowed_origins)
    for module in (
        chat, stored_completions, completions, responses, stored_responses, embeddings, scores, classify, moderations,
        streams, models_api, tokens, health, metrics, usage, conversations, batches, admin, lora, anthropic,
        anthropic_batches,
    ):
        app.include_router(module.router)
    install_page(app)
    return app
