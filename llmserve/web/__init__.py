"""The chat page: a static, offline web app (plain ES modules, no build step, no CDN) served at `/` by
`llmserve serve` and by the gateway. It talks to the OpenAI-compatible API with the key the user
types in (kept in the browser's localStorage), so the page itself is public."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
ASSET_PREFIX = "/web"

# Model output is rendered by the page's own DOM builder (never as HTML); the policy is a second wall:
# no inline or foreign script, nothing loaded from elsewhere, no framing.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def page_paths() -> frozenset[str]:
    """The page and its assets: answered without a key even when keys are on."""
    assets = (f"{ASSET_PREFIX}/{p.relative_to(STATIC_DIR).as_posix()}" for p in STATIC_DIR.rglob("*") if p.is_file())
    return frozenset({"/", *assets})


def install_page(app: FastAPI) -> None:
    """Serve the page at `/` and its assets under /web/."""

    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html", headers=_PAGE_HEADERS)

    app.add_api_route("/", index, methods=["GET"], include_in_schema=False)
    app.mount(ASSET_PREFIX, StaticFiles(directory=STATIC_DIR), name="web")
