"""A streaming OpenAI-compatible client that times every chunk of one request.

It speaks both /v1/completions (`choices[].text`) and /v1/chat/completions
(`choices[].delta.content`), reads the usage chunk that `stream_options.include_usage` asks for,
and turns every failure (HTTP status, broken connection, error event) into a failed
`RequestResult` instead of an exception.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from llmserve.bench.metrics import RequestResult

ERROR_BODY_CHARS = 300


def is_chat_endpoint(endpoint: str) -> bool:
    return "chat" in endpoint


def join_url(base_url: str, endpoint: str) -> str:
    """base_url + endpoint, tolerating a base URL that already ends in /v1."""
    base = base_url.rstrip("/")
    path = endpoint if endpoint.startswith("/") else f"/{endpoint}"
    if base.endswith("/v1") and path.startswith("/v1/"):
        base = base[: -len("/v1")]
    return base + path


def server_root(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def discover_model(client: httpx.Client, base_url: str) -> str:
    """The first model id the server lists at GET /v1/models."""
    response = client.get(join_url(base_url, "/v1/models"))
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url} lists no models; pass --model")
    return str(models[0]["id"])


@dataclass
class SamplingOptions:
    """Per-request body fields shared by every request of a run."""

    temperature: float = 0.0
    exact_output_len: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)


def build_payload(
    model: str,
    endpoint: str,
    prompt: str | list[int] | list[dict[str, str]],
    max_tokens: int,
    options: SamplingOptions,
) -> dict[str, Any]:
    """A streaming request body; `prompt` is the messages list for chat endpoints."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": options.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    body["messages" if is_chat_endpoint(endpoint) else "prompt"] = prompt
    if options.exact_output_len:
        body["min_tokens"] = max_tokens
    body.update(options.extra_body)
    return body


def _chunk_text(chunk: dict[str, Any]) -> str:
    """Generated text in one stream chunk (completion text, chat content or reasoning content)."""
    pieces: list[str] = []
    for choice in chunk.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        if isinstance(choice.get("text"), str):
            pieces.append(choice["text"])
        delta = choice.get("delta")
        if isinstance(delta, dict):
            for key in ("reasoning_content", "reasoning", "content"):
                if isinstance(delta.get(key), str):
                    pieces.append(delta[key])
    return "".join(pieces)


class _StreamState:
    """Accumulates timings and text while a stream is read."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.last: float | None = None
        self.result = RequestResult()
        self.pieces: list[str] = []
        self.chunks = 0
        self.usage: dict[str, Any] | None = None

    def on_text(self, text: str, now: float) -> None:
        if not text:
            return
        if self.last is None:
            self.result.ttft = now - self.start
        else:
            self.result.itl.append(now - self.last)
        self.last = now
        self.pieces.append(text)
        self.chunks += 1

    def on_event(self, data: str, now: float) -> bool:
        """Handle one `data:` payload; False once the stream is finished."""
        if data.strip() == "[DONE]":
            return False
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            raise ValueError(f"unexpected stream event {data[:100]!r}")
        if chunk.get("error"):
            raise _StreamError(json.dumps(chunk["error"])[:ERROR_BODY_CHARS])
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        self.on_text(_chunk_text(chunk), now)
        return True

    def finish(self, now: float, count_tokens: Callable[[str], int] | None) -> RequestResult:
        result = self.result
        result.latency = now - self.start
        result.generated_text = "".join(self.pieces)
        usage = self.usage or {}
        if usage.get("completion_tokens") is not None:
            result.output_tokens = int(usage["completion_tokens"])
        elif count_tokens is not None:
            result.output_tokens = count_tokens(result.generated_text)
        else:
            result.output_tokens = self.chunks
        if usage.get("prompt_tokens") is not None:
            result.input_tokens = int(usage["prompt_tokens"])
        if result.ttft is None and result.output_tokens > 0:
            result.ttft = result.latency  # only empty-text tokens (e.g. skipped special tokens) came back
        result.success = result.output_tokens > 0
        if not result.success:
            result.error = "EmptyResponse: the stream carried no generated tokens"
        return result


class _StreamError(Exception):
    """An error event inside an HTTP 200 stream."""


async def stream_request(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    count_tokens: Callable[[str], int] | None = None,
) -> RequestResult:
    """Send one streaming request and measure it; never raises for server or network failures."""
    start = time.perf_counter()
    state = _StreamState(start)
    try:
        async with client.stream("POST", url, json=payload) as response:
            state.result.status = response.status_code
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                return _failed(state, start, f"HTTP {response.status_code}: {body[:ERROR_BODY_CHARS]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments (": ping"), event names
                if not state.on_event(line[len("data:"):].strip(), time.perf_counter()):
                    break
    except _StreamError as exc:
        return _failed(state, start, f"StreamError: {exc}")
    except (httpx.HTTPError, OSError, ValueError) as exc:
        return _failed(state, start, f"{type(exc).__name__}: {exc}")
    return state.finish(time.perf_counter(), count_tokens)


def _failed(state: _StreamState, start: float, error: str) -> RequestResult:
    result = state.result
    result.success = False
    result.error = error
    result.latency = time.perf_counter() - start
    result.generated_text = "".join(state.pieces)
    return result
