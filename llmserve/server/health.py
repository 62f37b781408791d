"""GET /health and /version."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

import llmserve
from llmserve.server import errors
from llmserve.server.state import get_state

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """200 once every model is loaded and its engine runs; 503 (with the reason) otherwise."""
    state = get_state(request)
    loading = state.router.loading_names()
    if loading:
        raise errors.model_loading(loading[0], 5.0)
    for endpoint in state.endpoints():
        engine = endpoint.engine
        if not engine.is_healthy:
            error = engine.dead_error or RuntimeError("the engine thread is not running")
            raise errors.APIError(503, f"The engine of {endpoint.name} is not running: {error}", code="engine_dead")
    return Response(status_code=200)


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": llmserve.__version__})
