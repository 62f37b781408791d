"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and the handlers that
turn every exception a request can raise into one, with the right HTTP status."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmserve.errors import EngineClosedError, EngineDeadError, InvalidRequestError
from llmserve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


def error_type(status: int) -> str:
    return _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")


# nginx's "client closed request": never seen by the client, but shows in access logs.
CLIENT_CLOSED_REQUEST = 499


class ClientDisconnected(Exception):
    """The client went away before the response was ready (its engine requests are aborted)."""


class APIError(Exception):
    """An error to answer with as is."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,  # noqa: A002 - OpenAI's field name
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or error_type(status)
        self.headers = headers

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()

    def body_json(self) -> str:
        return json.dumps(self.body())

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist.",
        param="model",
        code="model_not_found",
        type="invalid_request_error",
    )


def model_loading(model: str, retry_after_s: float) -> APIError:
    seconds = max(1, math.ceil(retry_after_s))
    return APIError(
        503,
        f"The model `{model}` is still loading; retry in {seconds} s.",
        param="model",
        code="model_loading",
        headers={"Retry-After": str(seconds)},
    )


def unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


def reject_unsupported(found: Sequence[tuple[str, str]]) -> None:
    """Raise a 400 naming the first unsupported parameter in `found` ((param, message) pairs)."""
    if found:
        raise unsupported(*found[0])


def body_too_large(max_bytes: int) -> APIError:
    return APIError(
        413,
        f"The request body is larger than the server's limit of {max_bytes} bytes.",
        code="request_too_large",
    )


class BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` once a body without (or with a lying) Content-Length passes the limit.

    An HTTPException, so FastAPI's body parsing lets it through to the handler that answers 413."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413)
        self.max_bytes = max_bytes


def overloaded(message: str = "The server is overloaded; retry later.", retry_after: int = RETRY_AFTER_SECONDS) -> APIError:
    return APIError(503, message, code="overloaded", headers={"Retry-After": str(retry_after)})


def shutting_down() -> APIError:
    return APIError(
        503,
        "The server is shutting down: it is draining (requests already running finish) and takes no new ones.",
        code="shutting_down",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


def from_exception(exc: BaseException) -> APIError:
    """The API error for an exception from request handling (unexpected ones become a 500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, EngineClosedError):
        return shutting_down()
    if isinstance(exc, EngineDeadError):  # a new engine core is usually up within seconds
        return APIError(503, str(exc), code="engine_dead", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    return APIError(500, "The server had an error while processing your request.", code="internal_error")


def param_path(loc: Sequence[int | str]) -> str | None:
    """A pydantic error location as a parameter path: ("body", "messages", 0, "role") -> messages[0].role."""
    parts = list(loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc)
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "Invalid request.")
    first = errors[0]
    if first.get("type") == "json_too_deep":
        return APIError(400, first["msg"], code="invalid_json")
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(
            400, f"We could not parse the JSON body of your request. {detail}".strip(), code="invalid_json"
        )
    loc = first.get("loc", ())
    param = param_path(loc)
    if param is None:
        return APIError(400, "The request body must be a JSON object.", code="invalid_body")
    message = first.get("msg", "Invalid value")
    if first.get("type") == "extra_forbidden":
        return APIError(
            400, f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter"
        )
    if first.get("type") == "missing":
        return APIError(
            400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
        )
    return APIError(400, f"Invalid value for '{param}': {message}", param=param, code="invalid_value")


async def _handle_api_error(_: Request, exc: Exception) -> JSONResponse:
    return from_exception(exc).response()


async def _handle_validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc).response()


async def _handle_disconnect(_: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _handle_http(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if isinstance(exc, BodyTooLarge):
        return body_too_large(exc.max_bytes).response()
    headers = dict(exc.headers) if exc.headers else None
    return APIError(exc.status_code, str(exc.detail), headers=headers).response()


class CatchAllMiddleware:
    """Anything unexpected becomes a logged 500 in OpenAI's shape, and the connection stays usable.

    (A handler for `Exception` would run in Starlette's outermost middleware, which re-raises after
    answering, so the server would drop the connection.)"""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            logger.exception("unexpected error while handling %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise  # too late for an error response: let the server close the connection
            await from_exception(exc).response()(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _handle_api_error)
    app.add_exception_handler(InvalidRequestError, _handle_api_error)
    app.add_exception_handler(EngineClosedError, _handle_api_error)
    app.add_exception_handler(EngineDeadError, _handle_api_error)
    app.add_exception_handler(RequestValidationError, _handle_validation)
    app.add_exception_handler(ClientDisconnected, _handle_disconnect)
    app.add_exception_handler(StarletteHTTPException, _handle_http)
    app.add_middleware(CatchAllMiddleware)
