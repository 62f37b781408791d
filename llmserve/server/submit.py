"""Admitting a request and handing its prompt(s) to the engine, with engine errors renamed to the
request's own parameters."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from llmserve.engine.async_llm import RequestStream
from llmserve.errors import InvalidRequestError
from llmserve.sampling.params import SamplingParams
from llmserve.server.protocol import random_id
from llmserve.server.state import ServerState


async def start_requests(
    state: ServerState,
    id_prefix: str,
    prompts: Sequence[str | Sequence[int]],
    params: SamplingParams,
    priority: int = 0,
    rename: Mapping[str, str] | None = None,
    cache_salt: str | None = None,
) -> tuple[str, list[RequestStream]]:
    """Admit and add one engine request per prompt. Returns the response id and the streams; on any
    failure the requests already added are aborted and the error (params renamed) is raised."""
    state.admit(prompts)
    response_id = random_id(id_prefix)
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            request_id = response_id if len(prompts) == 1 else f"{response_id}-{i}"
            streams.append(await state.engine.add_request(request_id, prompt, params, priority, cache_salt))
    except InvalidRequestError as exc:
        for stream in streams:
            stream.abort()
        if rename and exc.param in rename:
            exc.param = rename[exc.param]
        raise
    except BaseException:
        for stream in streams:
            stream.abort()
        raise
    return response_id, streams
