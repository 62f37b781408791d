"""One validated request from its engine requests to the HTTP response, for chat and completions alike.

The endpoints parse the body, build the prompts and the sampling parameters, and hand them over as a
`PreparedRequest` together with their `ResponseShape` (how a choice, a chunk and a response look in
their API). From there this module owns the rest: the size check, the safety screen, starting the
engine requests (rate limits and admission included), running them to the end or streaming them as
server-sent events (several prompts' streams merged; choice j of prompt i has index i*n + j), the
safety output guard on every choice, the usage (counted once, by the meter), metering before the
response's last byte, error events, aborts and `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from llmserve.engine.messages import KVTransferParams
from llmserve.errors import InvalidRequestError, LLMServeError
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.platform.keys import ApiKey
from llmserve.sampling.params import SamplingParams
from llmserve.server import errors
from llmserve.server.gateway import PROGRESS_EVERY_TOKENS, Meter
from llmserve.server.protocol import CompletionTokensDetails, Usage, now
from llmserve.server.reasoning import ReasoningTokens
from llmserve.server.state import ModelEndpoint, ServerState
from llmserve.server.streaming import (
    PROGRESS_HEADER,
    SSE_DONE,
    STREAM_ID_HEADER,
    ChunkEnvelope,
    Delta,
    EventIds,
    StreamCursor,
    event_stream,
    final_outputs,
    merged,
    sse,
)
from llmserve.server.submit import (
    Started,
    check_request_size,
    check_structured_outputs,
    count_output_blocks,
    screen_prompts,
    start_requests,
)

Choice = BaseModel | str  # a rendered choice: its model, or its JSON from a fast encoder


class ChoiceRenderer(ABC):
    """One choice of a response, in an endpoint's shape; holds what rendering it needs to remember
    between chunks (a text offset, a post-processor's state)."""

    @abstractmethod
    def chunk_choice(self, delta: Delta, output: RequestOutput) -> Choice | None:
        """The streamed choice for what the choice gained (`delta`; `output` is its request's whole
        output so far), or None when there is nothing to send yet."""

    @abstractmethod
    def response_choice(
        self, completion: CompletionOutput, text: str, finish_reason: str | None, output: RequestOutput
    ) -> BaseModel:
        """The non-streamed choice: `text` and `finish_reason` are what may be shown of `completion`
        (the safety guard applied)."""


class ResponseShape(ABC):
    """How one endpoint's responses look, and what it does once a request has completed."""

    id_prefix: str  # of the response id: "chatcmpl", "cmpl"

    @abstractmethod
    def renderer(self, position: int, index: int) -> ChoiceRenderer:
        """The renderer of choice `index` (of the prompt at `position`)."""

    @abstractmethod
    def empty_chunk(self, response_id: str, created: int, model: str, usage: Usage | None) -> BaseModel:
        """A streamed chunk with no choices: without usage, the envelope every chunk is made in; with
        it, the usage chunk."""

    @abstractmethod
    def response(
        self, response_id: str, model: str, choices: list[BaseModel], usage: Usage, outputs: Sequence[RequestOutput]
    ) -> BaseModel:
        """The non-streamed response (`outputs`: its requests' last outputs)."""

    def first_chunk(self, response_id: str, created: int, model: str) -> BaseModel | None:
        """The envelope of the first chunk when it carries more than the others (vLLM's prompt token ids
        in chat's); None: the same as theirs."""
        return None

    def opening_chunks(self, prompts: int, n: int) -> list[list[Choice]]:
        """The choices of the chunks sent before any output (chat's role, echoed text), one list a chunk."""
        return []

    async def completed(self, outputs: Sequence[RequestOutput], cursors: Sequence[StreamCursor], blocked: bool,
                        response: Callable[[], dict]) -> None:
        """After a request ran to its end (metered, before the client sees the end): `outputs` are its
        requests' last outputs, `cursors` its choices' (in index order), `blocked` whether the safety
        guard stopped any choice, `response` gives the whole response as the client saw it (a streamed one's
        as the non-streamed response it adds up to). Nothing by default."""
        return None


@dataclass
class PreparedRequest:
    """A validated request, ready to run."""

    state: ServerState
    endpoint: ModelEndpoint
    key: ApiKey | None
    prompts: list[list[int]]  # token ids, one engine request each
    params: SamplingParams
    stream: bool
    include_usage: bool  # streamed: a last chunk with the usage
    continuous_usage: bool  # streamed: every chunk with the usage so far
    obfuscate: bool  # streamed: each chunk padded with random characters (`include_obfuscation`)
    screen_texts: Callable[[], Sequence[str]]  # what the safety pre-filter reads (called on a worker)
    screen_param: str  # the parameter a blocked prompt is reported on
    resumable: bool = False  # streamed: kept generating into a buffer when the client drops (server/streams.py)
    return_token_ids: bool = False  # the choices' token ids go out (vLLM's return_token_ids)
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer: KVTransferParams | None = None  # disaggregation: keep the prompt's KV, or pull it
    renames: Mapping[str, str] | None = None  # engine parameter names -> the request's own
    headers: dict[str, str] = field(default_factory=dict)  # more response headers
    reasoning: ReasoningTokens | None = None  # a reasoning model's chat reply: its usage counts reasoning tokens


async def respond(request: Request, prepared: PreparedRequest, shape: ResponseShape) -> Response:
    """Check, screen and start the request's engine requests, and answer: a JSON response, or an event stream."""
    state, endpoint = prepared.state, prepared.endpoint
    check_request_size(endpoint, prepared.prompts, prepared.params, prepared.renames)
    if prepared.kv_transfer is not None:
        check_kv_transfer(prepared.kv_transfer, len(prepared.prompts), prepared.stream)
    if state.screens_outputs and (prepared.params.logprobs is not None or prepared.return_token_ids):
        # Only the tokens within the text the screen releases may be shown: the engine says which.
        prepared.params = dataclasses.replace(prepared.params, track_text_ends=True)
    if prepared.params.structured_outputs is not None:
        await check_structured_outputs(state, prepared.params, prepared.renames)
    await screen_prompts(state, endpoint, prepared.screen_texts, prepared.screen_param)
    started = await start_requests(
        state,
        endpoint,
        prepared.key,
        shape.id_prefix,
        prepared.prompts,
        prepared.params,
        prepared.priority,
        prepared.renames,
        prepared.cache_salt,
        prepared.kv_transfer,
    )
    started.meter.reasoning = prepared.reasoning
    run = _Run(prepared, shape, started)
    headers = {**started.headers, **prepared.headers}
    if prepared.stream and prepared.resumable:
        owner = prepared.key.id if prepared.key is not None else None
        stream = state.streams.open(started.response_id, owner, run.events())
        return event_stream(stream.follow(), {**headers, STREAM_ID_HEADER: started.response_id})
    if prepared.stream:
        return event_stream(run.events(), headers)
    if request.headers.get(PROGRESS_HEADER):
        return event_stream(run.whole_with_progress(), headers)
    return JSONResponse(await run.to_end(request), headers=headers)


def check_kv_transfer(transfer: KVTransferParams, num_prompts: int, stream: bool) -> None:
    """What a request's kv_transfer_params asks of the API, beside what the engine checks."""
    if num_prompts != 1:
        raise InvalidRequestError("kv_transfer_params takes one prompt.", param="kv_transfer_params")
    if transfer.do_remote_decode and stream:
        raise InvalidRequestError("A request whose KV is kept for another replica (do_remote_decode) is not "
                                  "streamed: its answer carries where the KV is.", param="kv_transfer_params")


def usage_of(meter: Meter) -> Usage:
    """A request's usage: the meter has seen every output, so it has the counts."""
    usage = Usage.of(meter.prompt_tokens, meter.completion_tokens, meter.cached_tokens)
    if meter.predicted or meter.reasoning is not None:
        accepted, rejected = meter.prediction_tokens
        usage.completion_tokens_details = CompletionTokensDetails(
            reasoning_tokens=meter.reasoning_tokens, accepted_prediction_tokens=accepted,
            rejected_prediction_tokens=rejected)
    return usage


class _Run:
    """One started request: its choices (a stream cursor and a renderer each) and its two ways to the end."""

    def __init__(self, prepared: PreparedRequest, shape: ResponseShape, started: Started) -> None:
        self.prepared = prepared
        self.shape = shape
        self.started = started
        self.model = prepared.endpoint.name
        self.n = prepared.params.n
        state = prepared.state
        self.cursors = [StreamCursor(state.output_guard()) for _ in range(len(started.streams) * self.n)]
        self.renderers = [
            shape.renderer(position, position * self.n + j) for position in range(len(started.streams)) for j in range(self.n)
        ]
        self.finals: dict[int, RequestOutput] = {}  # streamed: each request's last output, by position

    def _count_blocks(self) -> bool:
        return count_output_blocks(self.prepared.state, self.model, self.started.response_id, self.cursors)

    async def to_end(self, request: Request) -> dict:
        """Run to the end (aborted on a disconnect); the response's JSON-ready dict, metered."""
        started = self.started
        outputs = await started.run_to_end(request, final_outputs(started.streams, started.meter.observe))
        return await self._whole(outputs)

    async def whole_with_progress(self) -> AsyncIterator[str]:
        """A non-streamed request asked for with `PROGRESS_HEADER` (by a gateway, which meters a request
        whose client left by what it learnt): an event with the usage so far every
        PROGRESS_EVERY_TOKENS tokens, then the response (what `to_end` answers) as the last event."""
        started = self.started
        meter = started.meter
        reported = 0
        progressed = asyncio.Event()

        def observe(position: int, output: RequestOutput) -> None:
            meter.observe(position, output)
            if meter.completion_tokens - reported >= PROGRESS_EVERY_TOKENS:
                progressed.set()

        work = asyncio.ensure_future(final_outputs(started.streams, observe))
        try:
            while not work.done():
                woken = asyncio.ensure_future(progressed.wait())
                try:
                    await asyncio.wait((work, woken), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    woken.cancel()
                if progressed.is_set() and not work.done():
                    progressed.clear()
                    reported = meter.completion_tokens
                    yield sse(json.dumps({"usage": usage_of(meter).model_dump()}))
            outputs = work.result()
        except (asyncio.CancelledError, GeneratorExit):  # the client left
            started.abort("disconnected")
            raise
        except BaseException:
            started.abort("error")
            raise
        finally:
            work.cancel()
        yield sse(json.dumps(await self._whole(outputs), ensure_ascii=False, separators=(",", ":")))
        yield SSE_DONE

    async def _whole(self, outputs: Sequence[RequestOutput]) -> dict:
        started = self.started
        status = "error"
        try:
            if self.prepared.params.prompt_logprobs is None:
                response = self._response_json(outputs)
            else:  # it grows with the prompt: built on a worker thread
                response = await self.prepared.state.workers.run(self._response_json, outputs)
            status = "content_filter" if self._count_blocks() else "completed"
            await started.meter.finish_durably(status)
            await self.shape.completed(outputs, self.cursors, status == "content_filter", lambda: response)
            return response
        finally:
            started.abort(status)

    def _response_json(self, outputs: Sequence[RequestOutput], streamed: bool = False) -> dict:
        """The non-streamed response of the requests' last outputs, as a JSON-ready dict; `streamed`: the one a
        streamed response adds up to (its choices as they were sent, rendered whole by fresh renderers)."""
        choices = []
        for position, output in enumerate(outputs):
            for completion in output.outputs:
                index = position * self.n + completion.index
                cursor = self.cursors[index]
                if streamed:
                    text, finish_reason = cursor.seen(completion)
                    renderer = self.shape.renderer(position, index)
                else:
                    text, finish_reason = cursor.visible(completion)
                    renderer = self.renderers[index]
                shown = cursor.shown(completion, len(text))
                choices.append(renderer.response_choice(shown, text, finish_reason, output))
        usage = usage_of(self.started.meter)
        return self.shape.response(self.started.response_id, self.model, choices, usage, outputs).model_dump()

    async def events(self) -> AsyncIterator[str]:
        """The streamed response's server-sent events, numbered (their SSE ids) for resuming."""
        started, shape = self.started, self.shape
        numbered = EventIds()
        streams, meter = started.streams, started.meter
        created = now()
        envelope = ChunkEnvelope(shape.empty_chunk(started.response_id, created, self.model, None),
                                 obfuscate=self.prepared.obfuscate)
        first = shape.first_chunk(started.response_id, created, self.model)
        status = "disconnected"  # unless the streams get to their end
        try:
            for i, choices in enumerate(shape.opening_chunks(len(streams), self.n)):
                opening = ChunkEnvelope(first, obfuscate=self.prepared.obfuscate) if i == 0 and first else envelope
                yield numbered(opening.event(choices, self._usage_so_far()))
            if len(streams) == 1:  # iterated directly: a merging generator costs a hop per token
                async for output in streams[0]:
                    choices = self._advance(0, output)
                    if choices:
                        yield numbered(envelope.event(choices, self._usage_so_far()))
                    if self.finals:
                        break
            else:
                async for position, output in merged(streams):
                    choices = self._advance(position, output)
                    if choices:
                        yield numbered(envelope.event(choices, self._usage_so_far()))
                    if len(self.finals) == len(streams):
                        break
            status = "content_filter" if self._count_blocks() else "completed"
            if self.prepared.include_usage:
                yield numbered(sse(shape.empty_chunk(started.response_id, created, self.model, usage_of(meter))))
            await meter.finish_durably(status)  # metered before the client sees the end
            finals = [self.finals[i] for i in sorted(self.finals)]
            # Rendered once, when first asked for (a stored completion and a conversation's turn both read it).
            whole = functools.cache(lambda: {**self._response_json(finals, streamed=True), "created": created})
            await shape.completed(finals, self.cursors, status == "content_filter", whole)
            yield numbered(SSE_DONE)
        except LLMServeError as exc:  # the engine died or is shutting down mid-stream
            status = "error"
            yield numbered(sse(errors.from_exception(exc).body_json()))
            await meter.finish_durably(status)
            yield numbered(SSE_DONE)
        finally:
            started.abort(status)

    def _usage_so_far(self) -> Usage | None:
        """The usage to put in every chunk, when the client asked for it."""
        return usage_of(self.started.meter) if self.prepared.continuous_usage else None

    def _advance(self, position: int, output: RequestOutput) -> list[Choice]:
        """Take a request's new output: metered, its choices' deltas rendered; once every choice is
        done, the output is the request's last (aborting it when the output filter stopped them all)."""
        self.started.meter.observe(position, output)
        n = self.n
        choices = []
        for completion in output.outputs:
            index = position * n + completion.index
            delta = self.cursors[index].advance(completion)
            if delta is not None:
                choice = self.renderers[index].chunk_choice(delta, output)
                if choice is not None:
                    choices.append(choice)
        if output.finished or all(c.done for c in self.cursors[position * n : (position + 1) * n]):
            self.finals[position] = output
            if not output.finished:
                self.started.streams[position].abort()  # every choice was stopped by the output filter
        return choices
