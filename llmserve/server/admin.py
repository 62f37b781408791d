"""POST /admin/reload: new weights for a served model, put in place without stopping it. POST
/admin/reset_prefix_cache (also vLLM's /reset_prefix_cache): forget a model's cached KV blocks, the pool's
and the second tier's (benchmarks start cold with it; an operator empties a disk tier).

The engine core reads and checks the checkpoint on a thread while it goes on stepping, then swaps the
weights in between two steps and empties its prefix cache (that KV came from the old weights): streams
running across the reload go on, and requests from then on see only the new weights. The checkpoint
must have the served model's architecture and shapes (a fine-tune, a new version of the same model);
one that does not fit is a 400 and changes nothing. Once keys exist, only an admin key may reload."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from llmserve.platform.keys import ApiKey
from llmserve.server.errors import APIError
from llmserve.server.gateway import request_key
from llmserve.server.openapi import documented
from llmserve.server.protocol import (
    ReloadRequest,
    ReloadResponse,
    ResetPrefixCacheRequest,
    ResetPrefixCacheResponse,
)
from llmserve.server.state import get_state

router = APIRouter()


def require_admin(key: ApiKey | None, action: str) -> None:
    """A 403 unless there are no keys or `key` is an admin's."""
    if key is not None and not key.is_admin:
        raise APIError(403, f"{action} needs an admin key.", code="admin_key_required")


@router.post("/admin/reload", response_model=None, responses=documented(ReloadResponse))
async def reload_weights(body: ReloadRequest, request: Request) -> JSONResponse:
    key = request_key(request.state)
    require_admin(key, "Reloading weights")
    endpoint = get_state(request).endpoint(body.model, key)
    if endpoint.lora is not None:
        raise APIError(400, f"{endpoint.name!r} is a LoRA adapter: reload its model {endpoint.parent!r}, or unload "
                       "the adapter and load it again (/v1/load_lora_adapter).", param="model", code="invalid_value")
    path = Path(body.path).expanduser()
    if not path.is_dir():
        raise APIError(400, f"{body.path} is not a directory on the server.", param="path", code="invalid_path")
    try:
        forgotten = await endpoint.engine.reload_weights(path)
    except AssertionError as exc:  # the engine core's answer: the checkpoint did not fit or not read
        raise APIError(400, f"Could not load the weights in {body.path}: {exc}", param="path",
                       code="weights_not_loaded") from None
    response = ReloadResponse(model=endpoint.name, path=str(path), cached_blocks_forgotten=forgotten)
    return JSONResponse(response.model_dump())


@router.post("/admin/reset_prefix_cache", response_model=None, responses=documented(ResetPrefixCacheResponse))
@router.post("/reset_prefix_cache", response_model=None, include_in_schema=False)
async def reset_prefix_cache(request: Request, body: ResetPrefixCacheRequest | None = None) -> JSONResponse:
    key = request_key(request.state)
    require_admin(key, "Resetting the prefix cache")
    endpoint = get_state(request).endpoint(body.model if body is not None else None, key)
    pool, tier = await endpoint.engine.reset_prefix_cache()
    response = ResetPrefixCacheResponse(model=endpoint.name, cached_blocks_forgotten=pool, offloaded_blocks_dropped=tier)
    return JSONResponse(response.model_dump())
