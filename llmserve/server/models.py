"""GET /v1/models and /v1/models/{id}: the served models and aliases this key may use."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from llmserve.server import errors
from llmserve.server.gateway import request_key
from llmserve.server.openapi import documented
from llmserve.server.protocol import ModelCard, ModelList
from llmserve.server.state import ServerState, get_state

router = APIRouter()


def _card(state: ServerState, name: str) -> ModelCard:
    endpoint = state.endpoint(name)
    return ModelCard(
        id=name,
        created=endpoint.created,
        root=endpoint.root if endpoint.name == name else endpoint.name,
        parent=endpoint.parent,
        max_model_len=endpoint.engine.max_model_len,
    )


@router.get("/v1/models", response_model=None, responses=documented(ModelList))
async def list_models(request: Request) -> JSONResponse:
    state = get_state(request)
    key = request_key(request.state)
    loading = state.router.loading_names()
    if loading and not state.endpoints():  # nothing to offer yet: say when to come back
        raise errors.model_loading(loading[0], 5.0)
    names = [n for n in state.router.ready_names() if key is None or key.allows_model(n)]
    return JSONResponse(ModelList(data=[_card(state, n) for n in names]).model_dump())


@router.get("/v1/models/{model_id:path}", response_model=None, responses=documented(ModelCard))
async def retrieve_model(model_id: str, request: Request) -> JSONResponse:
    state = get_state(request)
    key = request_key(request.state)
    if model_id not in state.router.names() or (key is not None and not key.allows_model(model_id)):
        raise errors.model_not_found(model_id)
    # An unlisted alias (a model's path as typed) is answered with the card of the model it names.
    name = model_id if model_id in state.router.ready_names() else state.endpoint(model_id).name
    return JSONResponse(_card(state, name).model_dump())
