"""Errors of Anthropic's API in Anthropic's shape: a request to /v1/messages (and its count_tokens and batches) that
is answered with an error, wherever the error came from (the key check, a limit, the request's validation, the
chat it runs as, a replica behind a gateway), gets `{"type": "error", "error": {"type", "message"}}` with the error
type Anthropic's clients know for the status. The OpenAI shape's `param` and `code` stay in `error` beside them.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmserve.server.protocol import ErrorInfo

ANTHROPIC_PATH = "/v1/messages"
# Anthropic's error types by HTTP status (docs.anthropic.com, "Errors").
ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 402: "billing_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
    529: "overloaded_error",
}


class AnthropicErrorResponse(BaseModel):
    """An error of Anthropic's API as it is answered (the OpenAPI document's)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["error"]
    error: ErrorInfo


def anthropic_error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error(status: int, body: dict[str, Any]) -> dict[str, Any]:
    """An error body (OpenAI's shape) in Anthropic's; one already in Anthropic's as it is."""
    if body.get("type") == "error" or not isinstance(body.get("error"), dict):
        return body
    error = body["error"]
    return {"type": "error", "error": {**error, "type": anthropic_error_type(status),
                                       "message": str(error.get("message", ""))}}


class AnthropicErrorMiddleware:
    """Rewrites the JSON error answers of Anthropic's API paths; every other answer passes as it is, streamed."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(ANTHROPIC_PATH):
            await self.app(scope, receive, send)
            return
        held: list[Message] = []  # an error's start and body, until its body is whole

        async def rewriting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                if message["status"] < 400 or not _is_json(message):
                    await send(message)
                else:
                    held.append(message)
                return
            if not held:
                await send(message)
                return
            held.append(message)
            if not message.get("more_body", False):
                await _send_rewritten(held, send)

        await self.app(scope, receive, rewriting_send)


def _is_json(start: Message) -> bool:
    return any(name.lower() == b"content-type" and value.startswith(b"application/json")
               for name, value in start.get("headers", []))


async def _send_rewritten(held: list[Message], send: Send) -> None:
    start, body = held[0], b"".join(message.get("body", b"") for message in held[1:])
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        body = json.dumps(anthropic_error(start["status"], data)).encode()
    headers = [(name, value) for name, value in start.get("headers", []) if name.lower() != b"content-length"]
    await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
