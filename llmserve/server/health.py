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
    engine = get_state(request).engine
    if not engine.is_healthy:
        error = engine.dead_error or RuntimeError("the engine thread is not running")
        raise errors.APIError(503, f"The engine is not running: {error}", code="engine_dead")
    return Response(status_code=200)


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": llmserve.__version__})
