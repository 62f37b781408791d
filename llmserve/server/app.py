"""The FastAPI application: routers, OpenAI-shaped error handling, and draining on shutdown."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

import llmserve
from llmserve.engine.async_llm import AsyncLLM
from llmserve.server import chat, completions, health, metrics, models, tokens
from llmserve.server.errors import install_error_handlers, shutting_down
from llmserve.server.slo import SLO
from llmserve.server.state import ServerState

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


def _lifespan(state: ServerState, owns_engine: bool, shutdown_timeout: float):
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        drainer = asyncio.create_task(_drain_telemetry(state))
        yield
        drainer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await drainer
        state.draining = True
        if owns_engine:
            await state.engine.shutdown(shutdown_timeout)

    return lifespan


async def _drain_telemetry(state: ServerState) -> None:
    """Keep the engine event queue short even when nobody scrapes /metrics."""
    while True:
        await asyncio.sleep(TELEMETRY_DRAIN_SECONDS)
        if state.telemetry is not None:
            state.telemetry.drain()


def build_app(
    engine_client: AsyncLLM,
    served_model_name: str,
    *,
    model_aliases: Sequence[str] = (),
    model_root: str | None = None,
    max_waiting_requests: int = 1024,
    owns_engine: bool = False,
    shutdown_timeout: float = 30.0,
    slo: SLO | None = None,
) -> FastAPI:
    """An OpenAI-compatible app over `engine_client`.

    With `owns_engine`, the app's shutdown (after the HTTP server drained) stops the engine, giving
    what still runs `shutdown_timeout` seconds; otherwise the caller closes the engine.
    """
    state = ServerState(
        engine=engine_client,
        served_model_name=served_model_name,
        model_aliases=tuple(a for a in model_aliases if a != served_model_name),
        model_root=model_root,
        max_waiting_requests=max_waiting_requests,
    )
    app = FastAPI(
        title="llmserve",
        version=llmserve.__version__,
        lifespan=_lifespan(state, owns_engine, shutdown_timeout),
        docs_url=None,
        redoc_url=None,
    )
    app.state.llmserve = state
    app.state.metrics_registry = metrics.make_registry(engine_client, served_model_name)
    state.telemetry = metrics.make_telemetry(
        engine_client, app.state.metrics_registry, served_model_name, slo or SLO()
    )
    install_error_handlers(app)
    app.add_middleware(DrainMiddleware, state=state)
    for module in (chat, completions, models, tokens, health, metrics):
        app.include_router(module.router)
    return app
