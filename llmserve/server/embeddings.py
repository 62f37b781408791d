"""POST /v1/embeddings (OpenAI's shape, with vLLM's `truncate_prompt_tokens`): each input becomes one
engine embedding request, batched by the engine's scheduler with whatever else runs. Tokenizing the
inputs and writing the response (both grow with the input) run on the worker pool; the safety
pre-filter, rate limits, admission control and metering are the ones completions go through."""

from __future__ import annotations

import base64
from collections.abc import Callable, Sequence

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from llmserve.engine.async_llm import RequestStream
from llmserve.errors import InvalidRequestError
from llmserve.model.pooling import PoolingParams
from llmserve.outputs import EmbeddingRequestOutput
from llmserve.platform.keys import ApiKey
from llmserve.server.gateway import Meter, request_key
from llmserve.server.openapi import documented
from llmserve.server.protocol import EmbeddingRequest, EmbeddingResponse, random_id
from llmserve.server.state import ModelEndpoint, ServerState, get_state
from llmserve.server.streaming import final_outputs
from llmserve.server.submit import Started, screen_prompts

router = APIRouter()

_JSON = msgspec.json.Encoder()


@router.post("/v1/embeddings", response_model=None, responses=documented(EmbeddingResponse))
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    state = get_state(request)
    key = request_key(request.state)
    endpoint = state.endpoint(body.model, key, routing_key=key.id if key is not None else body.user)
    processor = endpoint.engine.input_processor
    processor.check_can_embed()
    pooling = PoolingParams(body.dimensions)
    pooling.validate(processor.hidden_size)
    inputs = body.inputs()
    for item in inputs:
        if isinstance(item, str) and body.truncate_prompt_tokens is None:
            endpoint.prompt_bound.check(len(item), param="input")
    token_ids = await state.workers.run(_tokenize, endpoint, inputs, body.truncate_prompt_tokens)
    await screen_prompts(state, endpoint, lambda: [t for t in inputs if isinstance(t, str)], "input")
    started = await _start(state, endpoint, key, token_ids, pooling, body.priority)
    status = "error"
    try:
        outputs = await started.run_to_end(request, final_outputs(started.streams))
        content = await state.workers.run(_response_json, endpoint.name, outputs, body.encoding_format)
        status = "completed"
        await started.meter.finish_durably(status)
    finally:
        started.abort(status)
    return Response(content, media_type="application/json", headers=started.headers)


def _tokenize(endpoint: ModelEndpoint, inputs: Sequence[str | list[int]], truncate: int | None) -> list[list[int]]:
    """On a worker thread: each input's tokens, checked and truncated (an error names its input)."""
    processor = endpoint.engine.input_processor
    return [_indexed(processor.embedding_tokens, i, item, truncate, many=len(inputs) > 1) for i, item in enumerate(inputs)]


def _indexed(
    tokenize: Callable[[str | list[int], int | None], list[int]], index: int, item: str | list[int],
    truncate: int | None, many: bool,
) -> list[int]:
    try:
        return tokenize(item, truncate)
    except InvalidRequestError as exc:
        if many and exc.param == "input":
            exc.param = f"input[{index}]"
        raise


async def _start(
    state: ServerState, endpoint: ModelEndpoint, key: ApiKey | None, token_ids: list[list[int]],
    pooling: PoolingParams, priority: int,
) -> Started:
    """Rate-limit, admit and add one engine request per input (as `submit.start_requests` does for
    generation); on any failure what was added is aborted and the reservation returned."""
    response_id = random_id("embd")
    prompt_tokens = sum(map(len, token_ids))
    admission = None
    streams: list[RequestStream] = []
    try:
        if state.platform is not None:
            admission = await state.platform.admit(key, endpoint.name, prompt_tokens)
        endpoint.admit(token_ids, state.draining)
        for i, ids in enumerate(token_ids):
            request_id = response_id if len(token_ids) == 1 else f"{response_id}-{i}"
            streams.append(await endpoint.engine.add_embedding_request(request_id, ids, pooling, priority=priority))
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
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return _JSON.encode({
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(data)],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    })
