"""CORS for the browser pages of the origins allowed (`--allowed-origins`), in `llmserve serve` and
`llmserve gateway` alike."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

# Response headers a cross-origin page may read (beyond the CORS-safelisted ones).
EXPOSED_HEADERS = [
    "retry-after", "retry-after-ms", "x-conversation-id", "x-stream-id",
    *(f"x-ratelimit-{part}-{limit}" for part in ("limit", "remaining", "reset") for limit in ("requests", "tokens")),
]


def parse_origins(values: list[str]) -> list[str]:
    """--allowed-origins, repeated and/or comma-separated."""
    return [origin.strip() for value in values for origin in value.split(",") if origin.strip()]


def install_cors(app: FastAPI, allowed_origins: Sequence[str]) -> None:
    """CORS for `allowed_origins` ("*": any; none: same origin only). Call it after every other
    middleware, so it is outermost: preflights are answered before auth, and 401s, 429s and 503s carry
    the CORS headers a browser needs to show them. Keys travel in a header, not cookies."""
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"],
            expose_headers=EXPOSED_HEADERS,
        )
