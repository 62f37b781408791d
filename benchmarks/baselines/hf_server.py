"""A deliberately naive OpenAI-compatible server: `transformers` generate, one request at a time.

This is the baseline `llmserve bench serve` compares llmserve against. Every request takes one
global lock for its whole generation, so a second user waits until the first is done: no
batching, no paged KV cache, no prefix cache. It answers /v1/completions and
/v1/chat/completions (streaming SSE with `stream_options.include_usage`, or plain JSON),
/v1/models, /tokenize, /detokenize and /health.

    python benchmarks/baselines/hf_server.py --model DIR --port 8001 [--dtype bfloat16]

Tokens stream one SSE chunk each (empty text deltas, e.g. a held-back partial UTF-8 character,
are not sent). `ignore_eos` keeps generating through end-of-sequence tokens without masking them;
`min_tokens` masks them until that many tokens exist; temperature 0 is greedy.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

# The naive design under test: one generation at a time, everyone else queues on this lock.
GENERATE_LOCK = threading.Lock()

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class BadRequest(ValueError):
    """A client error, answered with HTTP 400."""


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


# ---------------------------------------------------------------------------------------------
# generation (runs in a worker thread, under GENERATE_LOCK)
# ---------------------------------------------------------------------------------------------


class _TokenStreamer(BaseStreamer):
    """Receives generate()'s tokens: the first put() is the prompt, then one new token per step."""

    def __init__(self, on_token: Callable[[int], None]) -> None:
        self.on_token = on_token
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.on_token(int(token))

    def end(self) -> None:
        pass


class _StopWhenCancelled(StoppingCriteria):
    def __init__(self, cancelled: threading.Event) -> None:
        self.cancelled = cancelled

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.cancelled.is_set(), dtype=torch.bool, device=input_ids.device)


class HFEngine:
    def __init__(self, model_dir: str, dtype: str, served_name: str) -> None:
        self.name = served_name
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
        self.max_model_len = int(getattr(self.model.config, "max_position_embeddings", 0) or 0) or None
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else next(
            iter(self.eos_ids), 0)

    # -- prompts -------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def completion_prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt
        raise BadRequest("prompt must be a string or a list of token ids (batches are not supported)")

    def chat_prompt_ids(self, messages: Any) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.encode(text, add_special_tokens=False)

    def check_length(self, request: GenerationRequest) -> None:
        total = len(request.prompt_ids) + request.max_tokens
        if self.max_model_len and total > self.max_model_len:
            raise BadRequest(f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.max_tokens}) "
                             f"exceeds the model's context of {self.max_model_len} tokens")

    # -- generation ----------------------------------------------------------------------------

    def _generation_config(self, request: GenerationRequest) -> Any:
        config = copy.deepcopy(self.model.generation_config)
        config.max_new_tokens = request.max_tokens
        config.min_new_tokens = min(request.min_tokens, request.max_tokens) or None
        config.pad_token_id = self.pad_id
        if request.ignore_eos:
            config.eos_token_id = []  # no stop tokens (None would fall back to the model default)
        if request.temperature > 0:
            config.do_sample, config.temperature, config.top_p = True, request.temperature, request.top_p
        else:
            config.do_sample, config.temperature, config.top_p, config.top_k = False, None, None, None
        return config

    @torch.inference_mode()
    def generate(self, request: GenerationRequest, on_token: Callable[[int], None],
                 cancelled: threading.Event) -> None:
        if request.seed is not None:
            torch.manual_seed(request.seed)
        input_ids = torch.tensor([request.prompt_ids], dtype=torch.long)
        self.model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=self._generation_config(request),
            streamer=_TokenStreamer(on_token),
            stopping_criteria=StoppingCriteriaList([_StopWhenCancelled(cancelled)]),
        )


# ---------------------------------------------------------------------------------------------
# bridging the worker thread to the event loop
# ---------------------------------------------------------------------------------------------


def _worker(engine: HFEngine, request: GenerationRequest, emit: Callable[[tuple[str, Any]], None],
            cancelled: threading.Event) -> None:
    with GENERATE_LOCK:
        if cancelled.is_set():
            return
        try:
            engine.generate(request, lambda token: emit(("token", token)), cancelled)
        except Exception as exc:  # reported to the client as an error event
            emit(("error", f"{type(exc).__name__}: {exc}"))
            return
    emit(("done", None))


async def generate_tokens(engine: HFEngine, request: GenerationRequest) -> AsyncIterator[int]:
    """Token ids as the worker thread produces them; closing the iterator cancels the generation."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
    cancelled = threading.Event()

    def emit(item: tuple[str, Any]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, item)

    threading.Thread(target=_worker, args=(engine, request, emit, cancelled), daemon=True).start()
    try:
        while True:
            kind, value = await queue.get()
            if kind == "token":
                yield value
            elif kind == "error":
                raise RuntimeError(value)
            else:
                return
    finally:
        cancelled.set()


class IncrementalDetokenizer:
    """Text deltas from a growing list of ids; holds back a trailing partial UTF-8 character."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""

    def add(self, token: int) -> str:
        self.ids.append(token)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if full.endswith("\ufffd"):
            return ""
        delta = full[len(self.text):]  # decoding is prefix-stable once no partial character is pending
        self.text = full
        return delta

    def flush(self) -> str:
        """Whatever was held back at the end (a dangling partial character decodes to U+FFFD)."""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        delta = full[len(self.text):]
        self.text = full
        return delta


# ---------------------------------------------------------------------------------------------
# OpenAI response shapes
# ---------------------------------------------------------------------------------------------


@dataclass
class ResponseShape:
    chat: bool
    request_id: str
    model: str
    created: int

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if first:
                delta["role"] = "assistant"
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish_reason}
        return {"id": self.request_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        body = self.chunk(None)
        body["choices"] = []
        body["usage"] = usage
        return body

    def full(self, text: str, finish_reason: str, usage: dict[str, int]) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason}
        return {"id": self.request_id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": usage}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finish_reason(engine: HFEngine, request: GenerationRequest, ids: list[int]) -> str:
    if len(ids) >= request.max_tokens or request.ignore_eos:
        return "length"
    return "stop" if ids and ids[-1] in engine.eos_ids else "length"


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def stream_response(engine: HFEngine, request: GenerationRequest, shape: ResponseShape,
                          include_usage: bool) -> AsyncIterator[str]:
    detok = IncrementalDetokenizer(engine.tokenizer)
    if shape.chat:
        yield _sse(shape.chunk("", first=True))
    try:
        async with contextlib.aclosing(generate_tokens(engine, request)) as tokens:
            async for token in tokens:
                delta = detok.add(token)
                if delta:
                    yield _sse(shape.chunk(delta))
    except RuntimeError as exc:
        yield _sse({"error": {"message": str(exc), "type": "internal_error", "code": 500}})
        yield "data: [DONE]\n\n"
        return
    rest = detok.flush()
    yield _sse(shape.chunk(rest or (None if shape.chat else ""), _finish_reason(engine, request, detok.ids)))
    if include_usage:
        yield _sse(shape.usage_chunk(_usage(len(request.prompt_ids), len(detok.ids))))
    yield "data: [DONE]\n\n"


async def full_response(engine: HFEngine, request: GenerationRequest, shape: ResponseShape) -> dict[str, Any]:
    detok = IncrementalDetokenizer(engine.tokenizer)
    async with contextlib.aclosing(generate_tokens(engine, request)) as tokens:
        async for token in tokens:
            detok.add(token)
    text = engine.tokenizer.decode(detok.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return shape.full(text, _finish_reason(engine, request, detok.ids), _usage(len(request.prompt_ids), len(detok.ids)))


# ---------------------------------------------------------------------------------------------
# the app
# ---------------------------------------------------------------------------------------------


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _int_field(body: dict[str, Any], *names: str, default: int | None = None) -> int | None:
    for name in names:
        if body.get(name) is not None:
            value = body[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise BadRequest(f"{name} must be a non-negative integer")
            return value
    return default


def parse_generation_request(engine: HFEngine, body: dict[str, Any], chat: bool) -> GenerationRequest:
    prompt_ids = engine.chat_prompt_ids(body.get("messages")) if chat else engine.completion_prompt_ids(
        body.get("prompt"))
    max_tokens = _int_field(body, "max_completion_tokens", "max_tokens", default=16 if not chat else None)
    if max_tokens is None:
        max_tokens = max((engine.max_model_len or 2048) - len(prompt_ids), 1)
    if max_tokens < 1:
        raise BadRequest("max_tokens must be >= 1")
    if (body.get("n") or 1) != 1:
        raise BadRequest("only n=1 is supported")
    request = GenerationRequest(
        prompt_ids=prompt_ids, max_tokens=max_tokens, min_tokens=_int_field(body, "min_tokens", default=0) or 0,
        ignore_eos=bool(body.get("ignore_eos", False)), temperature=float(body.get("temperature") or 0.0),
        top_p=float(body.get("top_p") or 1.0), seed=_int_field(body, "seed"),
    )
    engine.check_length(request)
    return request


def build_app(engine: HFEngine) -> FastAPI:
    app = FastAPI(title="naive transformers baseline")

    async def complete(raw: Request, chat: bool) -> Any:
        try:
            body = await raw.json()
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            request = parse_generation_request(engine, body, chat)
        except (BadRequest, ValueError, TypeError) as exc:
            return _error(400, str(exc))
        shape = ResponseShape(chat, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", engine.name,
                              int(time.time()))
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(stream_response(engine, request, shape, include_usage),
                                     media_type="text/event-stream")
        try:
            return await full_response(engine, request, shape)
        except RuntimeError as exc:
            return _error(500, str(exc), "internal_error")

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Any:
        return await complete(raw, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Any:
        return await complete(raw, chat=True)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": 0,
                                            "owned_by": "hf-baseline", "max_model_len": engine.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Any:
        body = await raw.json()
        try:
            if "messages" in body:
                tokens = engine.chat_prompt_ids(body["messages"])
            elif isinstance(body.get("prompt"), str):
                tokens = engine.encode(body["prompt"], bool(body.get("add_special_tokens", True)))
            else:
                raise BadRequest("give a prompt string or messages")
        except (BadRequest, ValueError, TypeError) as exc:
            return _error(400, str(exc))
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Any:
        body = await raw.json()
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return _error(400, "tokens must be a list of token ids")
        return {"prompt": engine.tokenizer.decode(tokens)}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def _default_name(model: str) -> str:
    """A local directory is served under its own name (as llmserve does); a hub id as given."""
    path = Path(model)
    return path.resolve().name if path.is_dir() else model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face model directory (or hub id)")
    parser.add_argument("--served-model-name", default=None, help="name in /v1/models (default: --model)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = HFEngine(args.model, args.dtype, args.served_model_name or _default_name(args.model))
    print(f"hf baseline: {engine.name} ({args.dtype}, CPU) on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(build_app(engine), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
