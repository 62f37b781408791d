"""LoRA adapters served under their own names (vLLM's): those a model's `--lora-modules` names, read at
start, and POST /v1/load_lora_adapter and /v1/unload_lora_adapter at run time (an admin key once keys exist).

An adapter is an endpoint of its own over its model's engine (`ModelEndpoint.adapter`): listed in
/v1/models with its `parent`, limited, metered and priced by its own name, and generating with its
`LoRARequest`. Each adapter read gets a new id, so one loaded again under the same name never reuses the
KV its predecessor cached. Unloading lets the requests that use it finish.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from llmserve.config import parse_lora_modules
from llmserve.model.lora_request import LoRARequest
from llmserve.server.admin import require_admin
from llmserve.server.errors import APIError
from llmserve.server.gateway import request_key
from llmserve.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from llmserve.server.state import ModelEndpoint, get_state

router = APIRouter()

_adapter_ids = itertools.count(1)  # unique in the process, so across its engines too


def configured_adapters(model: ModelEndpoint) -> list[ModelEndpoint]:
    """The endpoints of the adapters the model's `lora_modules` name, each read and checked (blocking: at
    start, on a loader thread). Raises InvalidRequestError for one that cannot be served."""
    modules = parse_lora_modules(model.engine.config.lora_modules or [])
    return [model.adapter(_read(model, module.name, module.path)) for module in modules]


def _read(model: ModelEndpoint, name: str, path: str) -> LoRARequest:
    lora = LoRARequest(name, next(_adapter_ids), str(Path(path).expanduser().resolve()))
    model.engine.check_lora(lora)
    return lora


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    state = get_state(request)
    key = request_key(request.state)
    require_admin(key, "Loading LoRA adapters")
    model = state.endpoint(body.model, key)
    if model.lora is not None:
        raise APIError(400, f"{model.name!r} is a LoRA adapter itself: name its model {model.parent!r}.",
                       param="model", code="invalid_value")
    if body.lora_name in state.router.names():
        raise _already_loaded(body.lora_name)
    lora = await state.workers.run(_read, model, body.lora_name, body.lora_path)
    try:
        state.router.add_model(body.lora_name, model.adapter(lora))
    except ValueError:  # loaded by a request that ran meanwhile
        raise _already_loaded(body.lora_name) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    state = get_state(request)
    require_admin(request_key(request.state), "Unloading LoRA adapters")
    name = body.lora_name
    try:
        adapter = state.router.handle(name)
    except KeyError:
        adapter = None
    if adapter is None or adapter.lora is None:
        raise APIError(404, f"The LoRA adapter '{name}' cannot be found.", param="lora_name", code="lora_not_found")
    try:
        state.router.remove_model(name)
    except ValueError as exc:  # an alias points at it
        raise APIError(400, f"The LoRA adapter '{name}' cannot be unloaded: {exc}", param="lora_name",
                       code="invalid_value") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _already_loaded(name: str) -> APIError:
    return APIError(400, f"The name '{name}' is already served: unload the adapter first, or choose another name.",
                    param="lora_name", code="invalid_value")
