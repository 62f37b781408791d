"""A tiny in-process OpenAI-compatible streaming server for benchmark tests.

Every completion streams exactly `max_tokens` one-word chunks (" r<request>t<i>"), then a usage
chunk and [DONE]. It records each request body, can reject every n-th request with 429, and
tokenizes by whitespace at /tokenize (which can be switched off).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "fake-model"


@dataclass
class FakeState:
    chunk_delay_s: float = 0.001
    reject_every: int = 0
    with_tokenize: bool = True
    requests: list[dict[str, Any]] = field(default_factory=list)


def _word_ids(text: str) -> list[int]:
    return [sum(word.encode()) % 1000 + 10 for word in text.split()]


def _prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(_text(m["content"]).split()) for m in body["messages"])
    prompt = body["prompt"]
    return len(prompt) if isinstance(prompt, list) else len(prompt.split())


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def _stream(body: dict[str, Any], request_id: int, state: FakeState) -> AsyncIterator[str]:
    chat = "messages" in body
    for i in range(int(body["max_tokens"])):
        await asyncio.sleep(state.chunk_delay_s)
        piece = f" r{request_id}t{i}"
        choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
        yield _sse({"id": f"req-{request_id}", "model": MODEL, "choices": [choice]})
    final = {"index": 0, "finish_reason": "length", **({"delta": {}} if chat else {"text": ""})}
    yield _sse({"id": f"req-{request_id}", "model": MODEL, "choices": [final]})
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = {"prompt_tokens": _prompt_tokens(body), "completion_tokens": int(body["max_tokens"])}
        yield _sse({"id": f"req-{request_id}", "model": MODEL, "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        if not state.with_tokenize:
            return JSONResponse({"error": "not found"}, status_code=404)
        body = await request.json()
        tokens = _word_ids(body["prompt"])
        return {"tokens": tokens, "count": len(tokens)}

    async def complete(request: Request) -> Any:
        body = await request.json()
        state.requests.append(body)
        request_id = len(state.requests)
        if state.reject_every and request_id % state.reject_every == 0:
            return JSONResponse({"error": {"message": "too many requests"}}, status_code=429)
        return StreamingResponse(_stream(body, request_id, state), media_type="text/event-stream")

    app.post("/v1/completions")(complete)
    app.post("/v1/chat/completions")(complete)
    return app


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def run_fake_server(state: FakeState) -> Iterator[str]:
    """Serve the fake app on a free 127.0.0.1 port in a thread; yields its base URL."""
    port = _free_port()
    config = uvicorn.Config(make_app(state), host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("fake server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _text(content: str | list[dict]) -> str:
    """A message's text: its text parts' (an image part has none)."""
    if isinstance(content, str):
        return content
    return " ".join(part["text"] for part in content if part["type"] == "text")
