"""The gateway's HTTP app: the OpenAI endpoints forwarded to the pool named by the body's `model`,
`/v1/models` (the pools), `/health` and `/metrics`."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from llmserve.gateway import errors
from llmserve.gateway.metrics import GatewayMetrics
from llmserve.gateway.pool import HealthChecker, Pool
from llmserve.gateway.prefix_index import PromptKey
from llmserve.gateway.proxy import Proxy, forwarded_headers
from llmserve.gateway.routing import policy_by_name
from llmserve.web import install_page

# Connecting is quick or the replica is gone; generating may take minutes.
REPLICA_TIMEOUT = httpx.Timeout(connect=2.0, read=600.0, write=30.0, pool=None)


class GatewayState:
    def __init__(
        self, pools: Mapping[str, Sequence[str]], policy: str, *, health_interval_s: float,
        health_timeout_s: float,
    ) -> None:
        self.pools = {name: Pool.of(name, urls, policy_by_name(policy)) for name, urls in pools.items()}
        self.metrics = GatewayMetrics(self.pools.values())
        for pool in self.pools.values():
            pool.on_eject = lambda pool, replica: self.metrics.ejections.labels(pool.name, replica.url).inc()
        self.client = httpx.AsyncClient(
            timeout=REPLICA_TIMEOUT, limits=httpx.Limits(max_connections=None, max_keepalive_connections=256)
        )
        self.proxy = Proxy(self.client, self.metrics)
        self.health = HealthChecker(
            list(self.pools.values()), self.client, interval_s=health_interval_s, timeout_s=health_timeout_s
        )
        self.created = int(time.time())


def prompt_key(payload: dict) -> PromptKey:
    """What the prefix policy routes on: a chat's message texts joined (a conversation's next turn
    starts with the same text), or a completion's prompt. O(prompt) on the event loop, as is parsing
    the body; fine at a few hundred KB."""
    if "messages" in payload:
        return "\n".join(_message_text(message) for message in payload.get("messages") or ())
    prompt = payload.get("prompt", "")
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return prompt  # token ids
        return first if isinstance(first, str) else [t for t in first if isinstance(t, int)]
    return prompt if isinstance(prompt, str) else ""


def _message_text(message: object) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return ""


def build_gateway_app(
    pools: Mapping[str, Sequence[str]], policy: str = "prefix", *, health_interval_s: float = 0.5,
    health_timeout_s: float = 0.5,
) -> FastAPI:
    """The gateway over `pools` (model name -> replica base URLs, e.g. http://10.0.0.5:8000)."""
    if not pools or any(not urls for urls in pools.values()):
        raise ValueError("The gateway needs at least one pool, each with at least one replica URL.")
    state = GatewayState(pools, policy, health_interval_s=health_interval_s, health_timeout_s=health_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.health.check_all()
        state.health.start()
        try:
            yield
        finally:
            await state.health.stop()
            await state.client.aclose()

    app = FastAPI(title="llmserve gateway", lifespan=lifespan)
    app.state.gateway = state

    async def forward(request: Request, path: str) -> Response:
        body = await request.body()
        try:
            payload = json.loads(body)
        except ValueError:
            return errors.error_response(400, "The request body is not valid JSON.", code="invalid_json")
        model = payload.get("model") if isinstance(payload, dict) else None
        if not isinstance(model, str):
            return errors.error_response(400, "`model` is required (a string).", param="model",
                                         code="missing_model")
        pool = state.pools.get(model)
        if pool is None:
            return errors.model_not_found(model)
        return await state.proxy.forward(pool, path, body, prompt_key(payload), forwarded_headers(request.headers))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(request, "/v1/completions")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        data = [{"id": name, "object": "model", "created": state.created, "owned_by": "llmserve"}
                for name in state.pools]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    install_page(app)  # the chat page (conversations and resuming need a replica's own API)
    return app
