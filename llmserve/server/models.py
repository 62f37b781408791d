"""GET /v1/models and /v1/models/{id}: the one model this server runs."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from llmserve.server import errors
from llmserve.server.protocol import ModelCard, ModelList
from llmserve.server.state import ServerState, get_state

router = APIRouter()


def _card(state: ServerState) -> ModelCard:
    return ModelCard(
        id=state.served_model_name,
        created=state.created,
        root=state.model_root,
        max_model_len=state.engine.max_model_len,
    )


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse(ModelList(data=[_card(get_state(request))]).model_dump())


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> JSONResponse:
    state = get_state(request)
    if model_id != state.served_model_name and model_id not in state.model_aliases:
        raise errors.model_not_found(model_id)
    return JSONResponse(_card(state).model_dump())
