"""The OpenAPI document as the server behaves: each main endpoint's response schema, and errors as
they are sent (a 400 in OpenAI's error shape where FastAPI would document its own 422; Anthropic's on its API)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from llmserve.server.anthropic_errors import ANTHROPIC_PATH, AnthropicErrorResponse
from llmserve.server.protocol import ErrorResponse

_ERROR_CONTENT = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
_ANTHROPIC_ERROR_CONTENT = {"application/json": {"schema": {"$ref": "#/components/schemas/AnthropicErrorResponse"}}}
_METHODS = ("get", "put", "post", "delete", "patch", "head", "options", "trace")


def documented(model: type[BaseModel], stream: bool = False, status: int = 200) -> dict[int | str, dict[str, Any]]:
    """A route's `responses=`: its `status` body is `model`, or server-sent events when `stream`
    (a route answering other than 200 also passes `status_code=status`)."""
    ok: dict[str, Any] = {"model": model, "description": "Successful Response"}
    if stream:
        ok["content"] = {"text/event-stream": {"schema": {"type": "string"}}}
    return {status: ok}


def install_openapi(app: FastAPI) -> None:
    """Generate the document once, with every operation's errors in OpenAI's shape."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title, version=app.version, routes=app.routes, description=app.description
            )
            _document_errors(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _document_errors(schema: dict[str, Any]) -> None:
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(error_schema.pop("$defs", {}))
    components["ErrorResponse"] = error_schema
    anthropic_schema = AnthropicErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    anthropic_schema.pop("$defs", None)  # ErrorInfo, as above
    components["AnthropicErrorResponse"] = anthropic_schema
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for path, item in schema.get("paths", {}).items():
        content = _ANTHROPIC_ERROR_CONTENT if path.startswith(ANTHROPIC_PATH) else _ERROR_CONTENT
        for method in _METHODS:
            operation = item.get(method)
            if operation is None:
                continue
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            if "requestBody" in operation or operation.get("parameters"):
                responses["400"] = {"description": "Invalid request", "content": content}
            responses["default"] = {"description": "Error", "content": content}
