"""POST /v1/embeddings (OpenAI's shape, with vLLM's `truncate_prompt_tokens`): each input becomes one
engine embedding request, batched by the engine's scheduler with whatever else runs. Tokenizing the
inputs and writing the response (both grow with the input) run on the worker pool; the safety
pre-filter, rate limits, admission control and metering are the ones completions go through."""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import msgspec
import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response

from llmserve.engine.async_llm import RequestStream
from llmserve.errors import InvalidRequestError
from llmserve.model.pooling import PoolingParams
from llmserve.outputs import EmbeddingRequestOutput
from llmserve.platform.keys import ApiKey
from llmserve.server.gateway import Meter, request_key
from llmserve.server.openapi import documented
from llmserve.server.protocol import EmbeddingRequest, EmbeddingResponse, random_id, texts_by_field
from llmserve.server.state import ModelEndpoint, ServerState, get_state
from llmserve.server.streaming import final_outputs
from llmserve.server.submit import Started, screen_prompts

router = APIRouter()

T = TypeVar("T")

_JSON = msgspec.json.Encoder()


@router.post("/v1/embeddings", response_model=None, responses=documented(EmbeddingResponse))
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    state = get_state(request)
    key = request_key(request.state)
    endpoint = state.endpoint(body.model, key, routing_key=key.id if key is not None else body.user)
    endpoint.check_generates("embeddings")
    endpoint.engine.input_processor.check_can_embed()
    pooling = PoolingParams(body.dimensions)
    pooling.validate(endpoint.engine.input_processor.hidden_size)
    inputs = Inputs.of_input(body.inputs(), body.truncate_prompt_tokens)
    return await embed(request, state, endpoint, key, inputs, pooling,
                       body.priority, lambda _, outputs: _response_json(endpoint.name, outputs, body.encoding_format))


@dataclass(frozen=True)
class Inputs:
    """What a request embeds: each input (text or token ids), the request field it came from (named in its
    errors), and how to truncate them (vLLM's `truncate_prompt_tokens`). A cross-encoder reads `pairs` of
    texts instead (indices into `items`), one engine request each."""

    items: Sequence[str | list[int]]
    params: Sequence[str]
    truncate: int | None
    pairs: Sequence[tuple[int, int]] | None = None

    @classmethod
    def of_input(cls, items: Sequence[str | list[int]], truncate: int | None) -> Inputs:
        """A request's `input` items, named "input" when alone, else "input[i]"."""
        params = [f"input[{i}]" for i in range(len(items))] if len(items) > 1 else ["input"]
        return cls(items, params, truncate)


async def embed(
    request: Request, state: ServerState, endpoint: ModelEndpoint, key: ApiKey | None, inputs: Inputs,
    pooling: PoolingParams, priority: int, answer: Callable[[str, Sequence[EmbeddingRequestOutput]], bytes],
    id_prefix: str = "embd", screen: bool = True,
) -> Response:
    """Embed every input (or pair), one engine request each (tokenized on the worker pool, screened unless
    `screen` is off, rate-limited, admitted and metered as a prompt), then answer with the body `answer` writes
    from the response id and the embeddings, on the worker pool too. Shared by /v1/embeddings, the scoring
    endpoints, /classify and /v1/moderations (whose texts are what it judges: not screened); the caller checks
    that the model serves what it asks."""
    for item, param in zip(inputs.items, inputs.params, strict=True):
        if isinstance(item, str) and inputs.truncate is None:
            endpoint.prompt_bound.check(len(item), param=param)
    tokenized = await state.workers.run(_tokenize, endpoint, inputs)
    for field, texts in texts_by_field(inputs.items, inputs.params).items() if screen else ():
        await screen_prompts(state, endpoint, lambda texts=texts: texts, field)  # a blocked text's error names its field
    started = await _start(state, endpoint, key, tokenized, pooling, priority, id_prefix)
    status = "error"
    try:
        outputs = await started.run_to_end(request, final_outputs(started.streams))
        content = await state.workers.run(answer, started.response_id, outputs)
        status = "completed"
        await started.meter.finish_durably(status)
    finally:
        started.abort(status)
    return Response(content, media_type="application/json", headers=started.headers)


def _tokenize(endpoint: ModelEndpoint, inputs: Inputs) -> list[tuple[list[int], int | None]]:
    """On a worker thread: each engine request's tokens, checked and truncated (an error names its input), and
    where a pair's second text starts."""
    processor = endpoint.engine.input_processor
    if inputs.pairs is not None:
        return [_named(partial(processor.pair_tokens, inputs.items[a], inputs.items[b], inputs.truncate),
                       inputs.params[b]) for a, b in inputs.pairs]
    return [(_named(partial(processor.embedding_tokens, item, inputs.truncate), param), None)
            for item, param in zip(inputs.items, inputs.params, strict=True)]


def _named(tokenize: Callable[[], T], param: str) -> T:
    try:
        return tokenize()
    except InvalidRequestError as exc:
        if exc.param == "input":
            exc.param = param
        raise


async def _start(
    state: ServerState, endpoint: ModelEndpoint, key: ApiKey | None, tokenized: list[tuple[list[int], int | None]],
    pooling: PoolingParams, priority: int, id_prefix: str,
) -> Started:
    """Rate-limit, admit and add one engine request per input (as `submit.start_requests` does for
    generation); on any failure what was added is aborted and the reservation returned."""
    response_id = random_id(id_prefix)
    token_ids = [ids for ids, _ in tokenized]
    prompt_tokens = sum(map(len, token_ids))
    admission = None
    streams: list[RequestStream] = []
    try:
        if state.platform is not None:
            priority = state.platform.priority_of(key, priority)
            admission = await state.platform.admit(key, endpoint.name, prompt_tokens)
        endpoint.admit(token_ids, state.draining, priority)
        for i, (ids, second_text_start) in enumerate(tokenized):
            request_id = response_id if len(token_ids) == 1 else f"{response_id}-{i}"
            params = pooling if second_text_start is None else dataclasses.replace(
                pooling, second_text_start=second_text_start)
            streams.append(await endpoint.engine.add_embedding_request(request_id, ids, params, priority=priority))
    except BaseException:
        for stream in streams:
            stream.abort()
        if admission is not None:
            admission.release()
        raise
    meter = Meter(state.platform, response_id, key, endpoint.name, admission, prompt_tokens)
    return Started(response_id, streams, meter, admission.headers if admission is not None else {})


def _response_json(model: str, outputs: Sequence[EmbeddingRequestOutput], encoding_format: str) -> bytes:
    """On a worker thread: the response body (float values, or float32 bytes in base64 as OpenAI's)."""
    if encoding_format == "base64":
        data = [base64.b64encode(o.outputs.data.tobytes()).decode() for o in outputs]
    else:
        data = [o.outputs.embedding for o in outputs]
    return _JSON.encode({
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
        "model": model,
        "usage": usage(outputs),
    })


async def embed_texts(state: ServerState, model: str, texts: Sequence[str]) -> np.ndarray:
    """The platform's own embeddings (a content router's), one row per text: each text cut to what the model
    embeds, one engine request each, neither limited nor metered (the request they route is)."""
    endpoint = state.endpoint(model)
    processor = endpoint.engine.input_processor
    processor.check_can_embed()
    token_ids = await state.workers.run(lambda: [processor.embedding_tokens(text, -1) for text in texts])
    streams: list[RequestStream] = []
    try:
        for ids in token_ids:
            streams.append(await endpoint.engine.add_embedding_request(random_id("route"), ids, PoolingParams()))
    except BaseException:
        for stream in streams:
            stream.abort()
        raise
    outputs = await final_outputs(streams)
    return np.stack([output.outputs.data for output in outputs])


def usage(outputs: Sequence[EmbeddingRequestOutput]) -> dict[str, int]:
    """A pooling request's usage: every engine request's prompt tokens, nothing generated."""
    tokens = sum(len(output.prompt_token_ids) for output in outputs)
    return {"prompt_tokens": tokens, "total_tokens": tokens}
