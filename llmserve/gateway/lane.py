"""The proxied requests' own way into a gateway that routes only (no platform): straight from the
server to the handler, past FastAPI.

FastAPI's middleware stack, routing and endpoint plumbing cost a proxied request more CPU than
choosing its replica does; none of them is needed to pass a body on. What they did for these paths is
done here: the body-size bound (413), errors in OpenAI's shape, a logged 500 for anything unexpected,
and a 405 for any other method."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping

from fastapi import FastAPI
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from llmserve.server.errors import CLIENT_CLOSED_REQUEST, APIError, body_too_large, from_exception
from llmserve.server.limits import content_length

logger = logging.getLogger(__name__)

# A proxied path's handler: the request's body and headers (names lowercase) to its response.
Handler = Callable[[bytes, dict[str, str]], Awaitable[Response]]


class _TooLarge(Exception):
    pass


class _HungUp(Exception):
    pass


class ProxyLane:
    """Answers the requests to `handlers`' paths (POSTs; any other method is a 405)."""

    def __init__(self, handlers: Mapping[str, Handler], max_body_bytes: int, skipped_headers: frozenset[str]) -> None:
        self.handlers = dict(handlers)
        self.max_body_bytes = max_body_bytes
        self.skipped_headers = skipped_headers  # not passed to the handler (hop-by-hop ones)

    def takes(self, scope: Scope) -> bool:
        return scope["type"] == "http" and scope["path"] in self.handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            await APIError(405, "Method Not Allowed", headers={"Allow": "POST"}).response()(scope, receive, send)
            return
        try:
            body = await self._body(scope, receive)
            response = await self.handlers[scope["path"]](body, self._headers(scope))
        except _TooLarge:
            response = body_too_large(self.max_body_bytes).response()
        except _HungUp:
            response = Response(status_code=CLIENT_CLOSED_REQUEST)
        except APIError as exc:
            response = exc.response()
        except Exception as exc:
            logger.exception("unexpected error while handling POST %s", scope["path"])
            response = from_exception(exc).response()
        await response(scope, receive, send)

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        """The whole body; over the bound: at once from its Content-Length, else once the bytes pass it."""
        declared = content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            raise _TooLarge()
        chunks = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _HungUp()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _TooLarge()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _headers(self, scope: Scope) -> dict[str, str]:
        headers = {}
        for raw_name, raw_value in scope["headers"]:  # the server's names are lowercase (ASGI)
            name = raw_name.decode("latin-1")
            if name not in self.skipped_headers:
                headers[name] = raw_value.decode("latin-1")
        return headers


class LaneApp(FastAPI):
    """FastAPI, with the requests its `lane` takes (when it has one) answered before its stack."""

    lane: ProxyLane | None = None
    lane_entry: ASGIApp | None = None  # the lane behind what must still run before it (`--api-key`'s check)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        lane = self.lane
        if lane is not None and lane.takes(scope):
            await (self.lane_entry or lane)(scope, receive, send)
            return
        await super().__call__(scope, receive, send)
