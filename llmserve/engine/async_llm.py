"""`AsyncLLM`: the server's engine client. The engine core runs in a process of its own
(`core_proc`); this side keeps what deals in text and in callers: validating and tokenizing requests
(the input processor), turning each step's token ids into text, stop strings and logprobs (the
output processor), and one `RequestStream` per request for the coroutine that serves it.

Everything here runs on one event loop (the server's), bound at first use: a task reads the core's
step messages and feeds the streams, so there is no thread to share the interpreter with. Only
`abort` (it also runs from garbage-collection finalizers) and `close` may be called from any thread.

A stream that is closed, cancelled or dropped before its request finished aborts the request, and
the core frees its KV blocks before its next step. If the core process dies (an exception in a step,
an OOM kill, `kill -9`), every request in flight fails at once with `EngineDeadError`, and a new core
is started in the background (a bounded number of times, with backoff); requests after that are
served normally.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from llmserve.config import EngineConfig
from llmserve.engine.beam_search import BeamSearchStream
from llmserve.engine.core_client import EngineCoreProcess, EngineCoreStartError
from llmserve.engine.input_processor import InputProcessor
from llmserve.engine.messages import (
    AbortRequests,
    EngineCoreDead,
    EngineCoreMessage,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    KVTransferParams,
    StepRecord,
    StopChoices,
    UtilityCall,
    UtilityResult,
)
from llmserve.engine.model_facts import load_model
from llmserve.engine.output_processor import OutputProcessor
from llmserve.errors import EngineClosedError, EngineDeadError, InvalidRequestError, LLMServeError
from llmserve.model.lora_request import LoRARequest
from llmserve.model.pooling import PoolingParams
from llmserve.outputs import EmbeddingRequestOutput, RequestOutput
from llmserve.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

RESTART_WINDOW_S = 60.0  # deaths within this long of each other count towards the limit below
MAX_RESTARTS_IN_WINDOW = 5
RESTART_BACKOFF_S = 0.5  # before the second restart in the window; doubling after that


@dataclass
class EngineEvents:
    """What one engine message brought, for listeners (metrics, load estimates): the step (None when
    there was none, e.g. for aborts) and every output delivered, aborted requests' final ones included.
    The outputs are the snapshots the callers got: listeners must not mutate them."""

    step: StepRecord | None
    outputs: list[RequestOutput]


EventListener = Callable[[EngineEvents], None]


class _Slot:
    """Where the engine's loop leaves one request's newest output (or the error that ends it). The
    engine holds the slot, never the `RequestStream`, so a stream nobody references any more is
    garbage-collected (and its finalizer aborts the request) even while the request runs."""

    __slots__ = ("item", "waiter")

    def __init__(self) -> None:
        self.item: RequestOutput | BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None  # the reader's, while it waits

    def put(self, item: RequestOutput | BaseException) -> None:
        if not isinstance(self.item, BaseException):  # an error is final
            self.item = item
            waiter = self.waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def take(self) -> RequestOutput | BaseException:
        """The newest item, once there is one."""
        if self.item is None:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        item, self.item = self.item, None
        assert item is not None
        return item


@dataclass
class _StreamState:
    """What the abort-on-drop finalizer needs, kept apart from the stream so it can outlive it."""

    request_id: str
    done: bool = False


class RequestStream:
    """The outputs of one request, in order, as an async iterator (created by `AsyncLLM.add_request`).

    Each `RequestOutput` is cumulative, so when several arrived since the last read only the newest is
    returned. The last one has `finished=True`. Closing the stream early (`abort()`, or dropping it)
    aborts the request.
    """

    def __init__(self, owner: AsyncLLM, request_id: str) -> None:
        self.request_id = request_id
        self._owner = owner
        self._slot = _Slot()
        self._state = _StreamState(request_id)
        weakref.finalize(self, _abort_if_unfinished, weakref.ref(owner), self._state)

    @property
    def finished(self) -> bool:
        return self._state.done

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._state.done:
            raise StopAsyncIteration
        item = await self._slot.take()
        if isinstance(item, BaseException):
            self._state.done = True
            raise item
        if item.finished:
            self._state.done = True
        return item

    def abort(self) -> None:
        """Stop the request unless it already finished; safe to call more than once."""
        if not self._state.done:
            self._state.done = True
            self._owner.abort(self.request_id)


def _abort_if_unfinished(owner_ref: weakref.ref[AsyncLLM], state: _StreamState) -> None:
    owner = owner_ref()
    if owner is not None and not state.done:
        state.done = True
        owner.abort(state.request_id)


class AsyncLLM:
    """The front end of one engine core process; serves requests from coroutines on one event loop."""

    def __init__(self, config: EngineConfig) -> None:
        self.facts, self.tokenizer = load_model(config)
        self.config = config = self.facts.settled(config)
        self.input_processor = InputProcessor(config, self.facts, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.model_config = self.facts.model_config
        self.model_dir = self.facts.model_dir
        self.max_model_len = self.facts.max_model_len
        self.vocab_size = self.facts.model_config.vocab_size
        self._streams: dict[str, _Slot] = {}  # the requests in flight
        self._listeners: list[EventListener] = []
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._reader: asyncio.Task | None = None
        self._outputs: zmq.asyncio.Socket | None = None  # the core's output socket, watched by the loop
        self._restarting: asyncio.Task | None = None
        self._deaths: collections.deque[float] = collections.deque()
        self._closed = False
        self._dead: EngineDeadError | None = None
        self._drained: asyncio.Future[None] | None = None  # set by shutdown(): resolved when no stream is left
        # Beam searches running (their tasks), and their one-token requests: listeners hear of a search once,
        # when it ends, not of its steps. A running search takes steps until the shutdown's drain is over.
        self._searches: set[asyncio.Task[RequestOutput]] = set()
        self._beam_steps: set[str] = set()
        self._steps_refused: EngineClosedError | None = None
        self.num_aborted = 0
        self.num_finished = 0
        self.num_restarts = 0
        self._core = self._start_core()
        self._attach(self._core)

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        """Start an engine core for `config` and wait until it is ready (blocking: loads the model)."""
        return cls(config)

    def _start_core(self) -> EngineCoreProcess:
        core = EngineCoreProcess(self.config, self.facts)
        core.wait_ready()
        logger.info("engine core ready (pid %s)", core.pid)
        return core

    def _attach(self, core: EngineCoreProcess) -> None:
        assert core.ready is not None
        self._core = core
        self._num_sent = 0
        self._in_transit: collections.deque[tuple[int, int]] = collections.deque()  # (nth sent, its priority)
        blocks = core.ready.num_blocks
        self._stats = EngineStats(0, 0, 0, blocks, blocks, 0, 0.0, 0)
        if self._loop is not None and not self._loop.is_closed():
            self._watch(core)

    # ---- read-only facts and state (safe from any thread) ------------------------------------------
    @property
    def engine_core_pid(self) -> int | None:
        return self._core.pid if self._dead is None else None

    def default_sampling_params(self) -> SamplingParams:
        return self.input_processor.default_sampling_params()

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and not self._closed and self._core.process.is_alive()

    @property
    def is_accepting(self) -> bool:
        return not self._closed and self.is_healthy

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    @property
    def last_stats(self) -> EngineStats:
        """The stats the engine core sent with its latest step."""
        return self._stats

    @property
    def num_waiting(self) -> int:
        """Requests added but not scheduled yet: on their way to the core or in its queue."""
        stats = self._stats
        return max(0, self._num_sent - stats.num_requests_added) + stats.num_waiting

    def queue_ahead(self, priority: int) -> tuple[int, int]:
        """What a new request of `priority` would wait behind: the requests waiting (on their way to the core
        or in its queue) and the prompt tokens still to prefill, less those of a later priority, which it would
        overtake (priority policy; under first come, first served it waits behind all)."""
        stats = self._stats
        behind = [(count, tokens) for p, count, tokens in stats.waiting_by_priority if p > priority]
        if self.config.scheduling_policy == "priority":  # those the core has not counted yet, by their priority
            behind.extend((1, 0) for _, p in self._unconfirmed() if p > priority)
        return (self.num_waiting - sum(count for count, _ in behind),
                stats.num_pending_prefill_tokens - sum(tokens for _, tokens in behind))

    def _unconfirmed(self) -> collections.deque[tuple[int, int]]:
        """The requests sent that the core's latest stats do not count as added yet."""
        added = self._stats.num_requests_added
        while self._in_transit and self._in_transit[0][0] < added:
            self._in_transit.popleft()
        return self._in_transit

    # ---- requests --------------------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        kv_transfer: KVTransferParams | None = None,
    ) -> RequestStream | BeamSearchStream:
        """Validate and queue a request (generated with `lora_request`'s adapter, when given; a beam search
        runs here, over one-token requests, and its stream yields its one output at the end). Raises
        InvalidRequestError (and subclasses) for bad input, EngineClosedError / EngineDeadError when no engine
        takes requests."""
        self._bind_loop()
        self._check_open()
        if params.use_beam_search:
            if request_id in self._streams:
                raise InvalidRequestError(f"Request id {request_id!r} is already in use.", param="request_id")
            return self._start_beam_search(request_id, prompt, params, priority, cache_salt, lora_request,
                                           kv_transfer)
        return self._add_generation(request_id, prompt, params, priority, cache_salt, lora_request, kv_transfer)

    def _add_generation(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, priority: int,
        cache_salt: str | None, lora_request: LoRARequest | None, kv_transfer: KVTransferParams | None = None,
    ) -> RequestStream:
        if request_id in self._streams:
            raise InvalidRequestError(f"Request id {request_id!r} is already in use.", param="request_id")
        request = self.input_processor.process(
            request_id, prompt, params, priority, cache_salt, lora_request, kv_transfer
        )
        return self._send_request(request, prompt)

    def _start_beam_search(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, priority: int,
        cache_salt: str | None, lora_request: LoRARequest | None, kv_transfer: KVTransferParams | None,
    ) -> BeamSearchStream:
        """The search runs as a task of this loop; each step's one-token requests are this engine's requests."""
        search = self.input_processor.beam_search(request_id, prompt, params, priority, cache_salt, lora_request,
                                                  kv_transfer)

        async def start_step(step_id: str, step_prompt: list[int], step_params: SamplingParams) -> RequestStream:
            if self._dead is not None:
                raise EngineDeadError(str(self._dead))
            if self._steps_refused is not None:
                raise self._steps_refused
            stream = self._add_generation(step_id, step_prompt, step_params, priority, cache_salt, lora_request)
            self._beam_steps.add(step_id)
            return stream

        processor = self.output_processor
        stream = BeamSearchStream(search, start_step, processor.tokenizer, processor.token_text)
        self._searches.add(stream.task)
        stream.task.add_done_callback(self._search_ended)
        return stream

    def _search_ended(self, task: asyncio.Task[RequestOutput]) -> None:
        """Listeners hear of a search that finished (not of one aborted or failed: no output came of it)."""
        self._searches.discard(task)
        if not task.cancelled() and task.exception() is None:
            self._notify(None, [task.result()])
        self._check_drained()

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter before requests use it (it reads files: call it off the event loop).
        Raises InvalidRequestError saying why it cannot be served."""
        self.input_processor.check_lora(lora_request)

    async def add_embedding_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        pooling: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Validate and queue an embedding request; its stream yields one `EmbeddingRequestOutput`.
        Raises as `add_request` does."""
        self._bind_loop()
        self._check_open()
        if request_id in self._streams:
            raise InvalidRequestError(f"Request id {request_id!r} is already in use.", param="request_id")
        request = self.input_processor.process_embedding(request_id, prompt, pooling, truncate_prompt_tokens, priority)
        return self._send_request(request, prompt)

    def _send_request(self, request: EngineCoreRequest, prompt: str | Sequence[int]) -> RequestStream:
        self.output_processor.add_request(request, prompt, time.monotonic())
        stream = RequestStream(self, request.request_id)
        self._streams[request.request_id] = stream._slot
        self._unconfirmed().append((self._num_sent, request.priority))
        self._num_sent += 1
        self._core.send(request)
        return stream

    async def generate(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as they come; stopping early (or being cancelled) aborts it."""
        stream = await self.add_request(request_id, prompt, params, priority)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str | Sequence[str]) -> None:
        """Abort requests (any thread; returns at once); unknown or finished ids are ignored."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        loop = self._loop
        if loop is not None and threading.get_ident() != self._loop_thread:
            try:
                loop.call_soon_threadsafe(self._abort, ids)
                return
            except RuntimeError:
                pass  # that loop is closed: nothing runs on it any more
        self._abort(ids)

    def _abort(self, request_ids: list[str]) -> None:
        live, outputs = [], []
        for request_id in request_ids:
            if self._streams.pop(request_id, None) is None:
                continue
            live.append(request_id)
            output = self.output_processor.abort(request_id)
            if output is not None:
                outputs.append(output)
        if not live:
            return
        self.num_aborted += len(live)
        self._core.send(AbortRequests(live))
        self._notify(None, outputs)
        self._check_drained()

    def add_listener(self, listener: EventListener) -> None:
        """Call `listener(EngineEvents)` on the engine's loop for every step and every abort. It must
        be quick (e.g. put the events on a queue read elsewhere)."""
        self._listeners.append(listener)

    # ---- the engine core's interface ---------------------------------------------------------------
    async def stats(self) -> EngineStats:
        """Fresh stats, taken by the engine core after every message sent before this call (the last
        ones it sent once it has stopped)."""
        if self._closed or self._dead is not None:
            return self._stats
        self._stats = msgspec.convert(await self._call("stats"), EngineStats)
        return self._stats

    async def check_invariants(self) -> None:
        """Run the engine core's block accounting check; raises AssertionError if it fails."""
        await self._call("check_invariants")

    async def reload_weights(self, model_dir: str | Path) -> int:
        """Replace the model's weights with the checkpoint in `model_dir` (same architecture and shapes)
        without stopping: the engine core reads it on a thread while steps go on and swaps it in between
        two steps, emptying its prefix cache; running requests go on. A restarted engine core loads it
        too. Returns the cached blocks forgotten; raises AssertionError naming why it did not fit."""
        forgotten = await self._call("reload_weights", str(model_dir))
        self.facts.model_dir = self.model_dir = Path(model_dir)
        return int(forgotten)  # type: ignore[arg-type]

    async def wait_idle(self) -> None:
        """Return once the engine core has no unfinished request (counting every message sent before)."""
        if self._closed and self._dead is None and not self._core.process.is_alive():
            return
        await self._call("wait_idle")

    async def reset_prefix_cache(self) -> tuple[int, int]:
        """Forget every cached KV block, the pool's and the second tier's; returns how many of each."""
        pool, tier = await self._call("reset_prefix_cache")  # type: ignore[misc]
        return int(pool), int(tier)

    async def _call(self, method: str, *args) -> object:
        self._bind_loop()
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        call_id = next(self._call_ids)
        future = self._loop.create_future()  # type: ignore[union-attr]
        self._calls[call_id] = future
        self._core.send(UtilityCall(call_id, method, list(args)))
        return await future

    # ---- shutdown ----------------------------------------------------------------------------------
    async def shutdown(self, timeout: float = 30.0) -> None:
        """Refuse new requests, let running ones finish for up to `timeout` seconds, abort the rest
        (their streams raise EngineClosedError) and stop the engine core."""
        self._bind_loop()
        self._closed = True
        deadline = time.monotonic() + timeout
        if (self._streams or self._searches) and self._dead is None:
            self._drained = asyncio.get_running_loop().create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self._drained), timeout)
            except asyncio.TimeoutError:
                pass
        error = EngineClosedError("The request was aborted because the server is shutting down.")
        self._steps_refused = error
        self._fail_streams(error)
        await asyncio.to_thread(self._core.shutdown, max(0.0, deadline - time.monotonic()) + 5.0)
        self._stop_watching()

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop at once (blocking): fail whatever is running and stop the engine core process."""
        self._closed = True
        loop = self._loop
        error = EngineClosedError("The request was aborted because the server is shutting down.")
        self._steps_refused = error
        if loop is not None and not loop.is_closed() and threading.get_ident() != self._loop_thread:
            try:
                loop.call_soon_threadsafe(self._fail_streams, error)
            except RuntimeError:
                self._fail_streams(error)
        else:
            self._fail_streams(error)
        self._core.shutdown(timeout if timeout is not None else 30.0)

    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if self._closed:
            raise EngineClosedError("The server is shutting down and takes no new requests.")

    def _fail_streams(self, error: LLMServeError) -> None:
        streams, self._streams = self._streams, {}
        outputs = [o for request_id in streams if (o := self.output_processor.abort(request_id)) is not None]
        for stream in streams.values():
            stream.put(error)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
        if outputs:
            self._notify(None, outputs)
        self._check_drained()

    # ================================================================================================
    # On the engine's event loop: reading the core's messages, noticing its death, restarting it.
    # ================================================================================================
    def _bind_loop(self) -> None:
        """Serve from the running loop; a new loop may take over once the previous one is closed."""
        loop = asyncio.get_running_loop()
        if loop is self._loop:
            return
        if self._loop is not None and not self._loop.is_closed() and self._loop.is_running():
            raise RuntimeError("AsyncLLM is already in use by another running event loop")
        self._loop, self._loop_thread = loop, threading.get_ident()
        if self._dead is None and not self._closed:
            self._watch(self._core)

    def _watch(self, core: EngineCoreProcess) -> None:
        loop = self._loop
        assert loop is not None
        self._outputs = zmq.asyncio.Socket.from_socket(core.output_socket)
        self._reader = loop.create_task(self._read(core, self._outputs))
        loop.add_reader(core.process.sentinel, self._on_exit, core)

    def _stop_watching(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._core.process.sentinel)
            if self._outputs is not None:
                # Before the socket closes: its file descriptor must leave the loop first, or a new
                # socket given the same number would never be watched.
                self._outputs.close()
        self._outputs = None

    async def _read(self, core: EngineCoreProcess, outputs: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frame = await outputs.recv(copy=False)
                self._handle(core, core.decoder.decode(frame.buffer))
        except zmq.ZMQError:
            return  # the socket was closed with its core

    def _handle(self, core: EngineCoreProcess, message: EngineCoreMessage) -> None:
        if core is not self._core:
            return
        if isinstance(message, EngineCoreOutputs):
            self._on_outputs(message)
        elif isinstance(message, UtilityResult):
            self._on_result(message)
        elif isinstance(message, EngineCoreDead):
            self._die(core, f"The engine failed: {message.error}")

    def _on_outputs(self, message: EngineCoreOutputs) -> None:
        if message.stats is not None:
            self._stats = message.stats
        processed = self.output_processor.process(message.outputs, message.prompt_logprobs)
        if processed.stopped:
            self._core.send(StopChoices(processed.stopped))
        streams = self._streams
        for output in processed.outputs:
            stream = streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del streams[output.request_id]
                self.num_finished += 1
            stream.put(output)
        # Listeners (metrics of generation) hear of the step, not of embeddings.
        self._notify(message.step, [o for o in processed.outputs if not isinstance(o, EmbeddingRequestOutput)])
        self._check_drained()

    def _check_drained(self) -> None:
        if self._drained is not None and not self._streams and not self._searches and not self._drained.done():
            self._drained.set_result(None)

    def _on_result(self, message: UtilityResult) -> None:
        future = self._calls.pop(message.call_id, None)
        if future is None or future.done():
            return
        if message.error is None:
            future.set_result(message.result)
        else:
            future.set_exception(AssertionError(message.error))

    def _notify(self, step: StepRecord | None, outputs: list[RequestOutput]) -> None:
        if self._beam_steps:
            outputs = self._without_beam_steps(outputs)
        if not self._listeners or (step is None and not outputs):
            return
        events = EngineEvents(step, outputs)
        for listener in self._listeners:
            try:
                listener(events)
            except Exception:  # a listener's bug must not stop the engine
                logger.exception("an engine event listener failed")

    def _without_beam_steps(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        kept = []
        for output in outputs:
            if output.request_id not in self._beam_steps:
                kept.append(output)
            elif output.finished:
                self._beam_steps.discard(output.request_id)
        return kept

    def _on_exit(self, core: EngineCoreProcess) -> None:
        """The core's process ended: read what it said last, then fail its requests."""
        if self._loop is not None:
            self._loop.remove_reader(core.process.sentinel)
        if core is not self._core or self._dead is not None:
            return
        while True:
            try:
                frame = core.output_socket.recv(zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            self._handle(core, core.decoder.decode(frame))
        if self._dead is None and not self._closed:
            core.process.join(1.0)
            self._die(core, f"The engine core process exited unexpectedly (exit status {core.process.exitcode}).")

    def _die(self, core: EngineCoreProcess, reason: str) -> None:
        if self._closed:
            return
        logger.error("engine core (pid %s) died: %s", core.pid, reason)
        self._dead = EngineDeadError(reason)
        self._fail_streams(self._dead)
        self._stop_watching()
        core.close()
        self._restarting = self._loop.create_task(self._restart())  # type: ignore[union-attr]

    async def _restart(self) -> None:
        """Start a new engine core: at once the first time, with a doubling wait when deaths come
        close together, and not at all past MAX_RESTARTS_IN_WINDOW deaths in RESTART_WINDOW_S."""
        while not self._closed:
            now = time.monotonic()
            while self._deaths and now - self._deaths[0] > RESTART_WINDOW_S:
                self._deaths.popleft()
            if len(self._deaths) >= MAX_RESTARTS_IN_WINDOW:
                logger.error("the engine core died %d times within %.0f s: not restarting it again",
                             len(self._deaths) + 1, RESTART_WINDOW_S)
                return
            if self._deaths:
                await asyncio.sleep(RESTART_BACKOFF_S * 2 ** (len(self._deaths) - 1))
            self._deaths.append(now)
            logger.warning("starting a new engine core")
            try:
                core = await asyncio.to_thread(self._start_core)
            except EngineCoreStartError as exc:
                logger.error("the new engine core failed to start: %s", exc)
                continue
            if self._closed:
                core.shutdown(5.0)
                return
            self._attach(core)
            self._dead = None
            self.num_restarts += 1
            logger.warning("the engine core was restarted (pid %s)", core.pid)
            return

