"""From a validated request to running engine requests: the safety pre-filter, the key's rate limits,
admission control, and the engine requests themselves, with engine errors renamed to the request's
own parameters. What comes back carries the meter that records the request's usage at its end."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request

from llmserve.engine.async_llm import RequestStream
from llmserve.engine.grammar import validate_structured_outputs
from llmserve.engine.messages import KVTransferParams
from llmserve.errors import InvalidRequestError
from llmserve.platform.keys import ApiKey
from llmserve.sampling.params import SamplingParams
from llmserve.server.errors import ClientDisconnected
from llmserve.server.gateway import Meter
from llmserve.server.protocol import random_id
from llmserve.server.state import ModelEndpoint, ServerState
from llmserve.server.streaming import StreamCursor, until_disconnect

T = TypeVar("T")

# n × max_tokens (over every prompt of a request) may reserve at most this many context windows.
MAX_COMPLETION_WINDOWS = 16

logger = logging.getLogger(__name__)


@dataclass
class Started:
    response_id: str
    streams: list[RequestStream]
    meter: Meter
    headers: dict[str, str]  # rate-limit headers for the response

    def abort(self, status: str) -> None:
        for stream in self.streams:
            stream.abort()
        self.meter.finish(status)

    async def run_to_end(self, request: Request, work: Awaitable[T]) -> T:
        """Await a non-streamed request's `work`; on a disconnect or failure, abort the engine requests
        and record the usage (what was generated) before re-raising."""
        try:
            return await until_disconnect(request, work)
        except ClientDisconnected:
            self.abort("disconnected")
            raise
        except BaseException:
            self.abort("error")
            raise


async def screen_prompts(
    state: ServerState, endpoint: ModelEndpoint, texts: Callable[[], Sequence[str]], param: str
) -> None:
    """The safety pre-filter over `texts()`, on a worker thread: a blocked prompt is a 400
    `content_filter`, before any engine work."""
    platform = state.platform
    if platform is not None and platform.safety is not None:
        await state.workers.run(lambda: platform.check_prompt(endpoint.name, texts(), param))


def count_output_blocks(
    state: ServerState, model: str, response_id: str, cursors: Iterable[StreamCursor]
) -> bool:
    """The safety post-filter's bookkeeping: count and log each choice it stopped; whether any was."""
    blocked = [c.blocked for c in cursors if c.blocked is not None]
    if blocked and state.platform is not None:
        state.platform.count_blocked_outputs(model, response_id, blocked)
    return bool(blocked)


def reserved_tokens(endpoint: ModelEndpoint, prompts: Sequence[Sequence[int]], params: SamplingParams) -> int:
    """What a request may use at most: its prompts plus every choice's completion budget (raises for
    a prompt that leaves no room in the context window, and when n × max_tokens is over the limit)."""
    budget = endpoint.engine.input_processor.max_tokens
    completion = sum(params.n * budget(len(prompt), params) for prompt in prompts)
    limit = MAX_COMPLETION_WINDOWS * endpoint.engine.max_model_len
    if completion > limit:
        raise InvalidRequestError(
            f"This request asks for up to {completion} completion tokens (n × max_tokens over its prompts); "
            f"the limit is {limit}. Please reduce n or max_tokens.",
            param="n",
        )
    return sum(len(prompt) for prompt in prompts) + completion


def check_request_size(
    endpoint: ModelEndpoint,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    rename: Mapping[str, str] | None = None,
) -> None:
    """The prompts' lengths against the context window and the completion budget against its limit,
    before any further work (the safety screen, rate limits, the engine)."""
    try:
        reserved_tokens(endpoint, prompts, params)
    except InvalidRequestError as exc:
        _rename(exc, rename)
        raise


async def check_structured_outputs(
    state: ServerState, params: SamplingParams, rename: Mapping[str, str] | None = None
) -> None:
    """The output constraint's grammar is checked on a worker thread (it grows with the schema); the
    engine client's own check of it is then a cache hit."""
    try:
        await state.workers.run(validate_structured_outputs, params)
    except InvalidRequestError as exc:
        _rename(exc, rename)
        raise


def _rename(exc: InvalidRequestError, rename: Mapping[str, str] | None) -> None:
    if rename and exc.param in rename:
        exc.param = rename[exc.param]


async def start_requests(
    state: ServerState,
    endpoint: ModelEndpoint,
    key: ApiKey | None,
    id_prefix: str,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    priority: int = 0,
    rename: Mapping[str, str] | None = None,
    cache_salt: str | None = None,
    kv_transfer: KVTransferParams | None = None,
) -> Started:
    """Rate-limit, admit and add one engine request per prompt (token ids). On any failure the
    requests already added are aborted, the reservation is returned, and the error (params renamed)
    is raised."""
    admission = None
    response_id = random_id(id_prefix)
    streams: list[RequestStream] = []
    try:
        if state.platform is not None:
            priority = state.platform.priority_of(key, priority)
            admission = await state.platform.admit(key, endpoint.name, reserved_tokens(endpoint, prompts, params))
        endpoint.admit(prompts, state.draining, priority)
        for i, prompt in enumerate(prompts):
            request_id = response_id if len(prompts) == 1 else f"{response_id}-{i}"
            streams.append(
                await endpoint.engine.add_request(
                    request_id, prompt, params, priority, cache_salt, endpoint.lora, kv_transfer
                )
            )
    except BaseException as exc:
        for stream in streams:
            stream.abort()
        if admission is not None:
            admission.release()
        if isinstance(exc, InvalidRequestError):
            _rename(exc, rename)
        raise
    meter = Meter(state.platform, response_id, key, endpoint.name, admission, sum(len(p) for p in prompts))
    meter.predicted = params.prediction_token_ids is not None
    return Started(response_id, streams, meter, admission.headers if admission is not None else {})
