"""GET /health and /version."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

import llmserve
from llmserve.server import errors
from llmserve.server.openapi import documented
from llmserve.server.protocol import HealthResponse, VersionResponse
from llmserve.server.state import get_state

router = APIRouter()


@router.get("/health", response_model=None, responses=documented(HealthResponse))
async def health(request: Request) -> JSONResponse:
    """200 `{"status": "ok"}` once every model is loaded and its engine runs; 503 (an error naming the
    reason) otherwise."""
    state = get_state(request)
    loading = state.router.loading_names()
    if loading:
        raise errors.model_loading(loading[0], 5.0)
    for endpoint in state.endpoints():
        engine = endpoint.engine
        if not engine.is_healthy:
            error = engine.dead_error or RuntimeError("the engine thread is not running")
            raise errors.APIError(503, f"The engine of {endpoint.name} is not running: {error}", code="engine_dead")
    return JSONResponse(HealthResponse().model_dump())


@router.get("/version", response_model=None, responses=documented(VersionResponse))
async def version() -> JSONResponse:
    return JSONResponse(VersionResponse(version=llmserve.__version__).model_dump())
