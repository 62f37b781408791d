"""`AsyncLLM`: the synchronous `LLMEngine` driven from a dedicated thread, for asyncio callers.

The engine is not thread-safe, so exactly one thread (the engine thread) touches it. Callers on an
event loop send commands (add, abort, ...) through a thread-safe queue; the engine thread drains the
queue, steps the engine while there is work and blocks on the queue when there is none. The outputs
of one step go back to each caller's event loop in a single `call_soon_threadsafe` call, where they
land in a per-request `asyncio.Queue` that `RequestStream` reads.

Requests from every caller join the same running batch, so HTTP requests are batched continuously.
A stream that is closed, cancelled or dropped before its request finished aborts the request, and the
engine frees its KV blocks before its next step.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from llmserve.config import EngineConfig
from llmserve.engine.llm_engine import EngineStats, LLMEngine, StepRecord
from llmserve.errors import InvalidRequestError, LLMServeError
from llmserve.outputs import RequestOutput
from llmserve.sampling.params import SamplingParams
from llmserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(LLMServeError):
    """The engine thread crashed; no request can be served any more."""


class EngineClosedError(LLMServeError):
    """The engine is shutting down: it takes no new requests, or it stopped this one."""


# ---- commands: what callers send to the engine thread ------------------------------------------


@dataclass
class _Add:
    sink: _Sink
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str | None = None


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    """Run `fn(engine)` on the engine thread and resolve `future` with the result."""

    fn: Callable[[LLMEngine], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass
class _IdleWaiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass
class _Stop:
    pass


_Command = _Add | _Abort | _Call | _IdleWaiter | _Stop


@dataclass
class EngineEvents:
    """What one round of the engine thread did, for listeners (metrics, load estimates): the step
    (None when no step ran) and every output delivered, aborted requests' final ones included.
    The outputs are the detached copies the callers got: listeners must not mutate them."""

    step: StepRecord | None
    outputs: list[RequestOutput]


EventListener = Callable[[EngineEvents], None]


# ---- the caller's side of one request ----------------------------------------------------------


class _Sink:
    """Where the engine thread delivers one request's outputs: its caller's loop and queue.

    The engine thread holds the sink, never the `RequestStream`, so a stream nobody references any
    more is garbage-collected (and its finalizer aborts the request) even while the request runs."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.accepted: asyncio.Future[None] = loop.create_future()

    # -- called on the event loop by the engine thread's deliveries --
    def push(self, item: RequestOutput | BaseException) -> None:
        self.accept(item if isinstance(item, BaseException) else None)
        self.queue.put_nowait(item)

    def accept(self, error: BaseException | None) -> None:
        if self.accepted.done():
            return
        if error is None:
            self.accepted.set_result(None)
        else:
            self.accepted.set_exception(error)


@dataclass
class _StreamState:
    """What the abort-on-drop finalizer needs, kept apart from the stream so it can outlive it."""

    request_id: str
    done: bool = False


class RequestStream:
    """The outputs of one request, in order, as an async iterator (created by `AsyncLLM.add_request`).

    Each `RequestOutput` is cumulative, so when several are waiting only the newest is returned. The
    last one has `finished=True`. Closing the stream early (`abort()`, or dropping it) aborts the request.
    """

    def __init__(
        self, owner: AsyncLLM, request_id: str, prompt: str | None, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self._owner = owner
        self._sink = _Sink(request_id, loop)
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
        queue_ = self._sink.queue
        item = await queue_.get()
        while not isinstance(item, BaseException) and not item.finished and not queue_.empty():
            item = queue_.get_nowait()  # outputs are cumulative: the newest one says it all
        if isinstance(item, BaseException):
            self._state.done = True
            raise item
        if item.finished:
            self._state.done = True
        if self.prompt is not None:
            item.prompt = self.prompt
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


# ---- the engine client ----------------------------------------------------------------------------


class AsyncLLM:
    """Runs one `LLMEngine` on a daemon thread and serves requests from any number of coroutines."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self.tokenizer: Tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.model_config = engine.model_config
        self.model_dir = engine.model_dir
        self.vocab_size: int = engine.model_config.vocab_size
        self._default_params = engine.default_sampling_params()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _pending_adds, _snapshot, _closed, _stopped, _dead
        self._pending_adds = 0
        self._snapshot = engine.stats()
        self._closed = False  # no new requests
        self._stopped = False  # the engine thread ended on purpose
        self._dead: EngineDeadError | None = None
        self.num_aborted = 0
        self.num_finished = 0
        # Engine-thread state: never touched from elsewhere.
        self._live: dict[str, _Sink] = {}
        self._inbox: collections.deque[_Command] = collections.deque()
        self._idle_waiters: list[_IdleWaiter] = []
        self._deliveries: dict[asyncio.AbstractEventLoop, list[Callable[[], None]]] = {}
        self._listeners: list[EventListener] = []
        self._round_outputs: list[RequestOutput] = []
        self._thread = threading.Thread(target=self._run, name="llmserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        return cls(LLMEngine(config))

    # ---- read-only facts about the model (set once, safe from any thread) -----------------------
    def default_sampling_params(self) -> SamplingParams:
        return dataclasses.replace(self._default_params)

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def is_accepting(self) -> bool:
        return not self._closed and self.is_healthy

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    @property
    def last_stats(self) -> EngineStats:
        """The stats the engine thread published last (after its latest step or command batch)."""
        with self._lock:
            return self._snapshot

    @property
    def num_waiting(self) -> int:
        """Requests added but not scheduled yet: still in the command queue or in the engine's queue."""
        with self._lock:
            return self._pending_adds + self._snapshot.num_waiting

    # ---- requests --------------------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue a request and wait until the engine took it. Raises what `LLMEngine.add_request`
        raises (InvalidRequestError and subclasses), or EngineClosedError / EngineDeadError."""
        text = prompt if isinstance(prompt, str) else None
        if text == "":  # as LLMEngine.add_request: encoding "" could still give a BOS token
            raise InvalidRequestError("The prompt is empty.", param="prompt")
        # Tokenized here, on the caller's side, so the engine thread never waits on text processing.
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        stream = RequestStream(self, request_id, text, asyncio.get_running_loop())
        try:
            self._submit(_Add(stream._sink, token_ids, params, priority, cache_salt), counts_as_add=True)
        except LLMServeError:
            stream._state.done = True
            raise
        try:
            await stream._sink.accepted
        except BaseException:
            stream.abort()  # cancelled while waiting, or refused: nothing (more) to run
            raise
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
        """Abort requests (thread-safe, returns at once); unknown or finished ids are ignored.

        It takes no lock: it also runs from garbage-collection finalizers, on any thread. When the
        engine thread has ended the command is simply never read (that thread aborted everything)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._commands.put(_Abort(ids))

    def add_listener(self, listener: EventListener) -> None:
        """Call `listener(EngineEvents)` on the engine thread after every round with outputs or a step.
        It must be quick and thread-safe (e.g. put the events on a queue read elsewhere)."""
        self._listeners.append(listener)

    # ---- introspection ---------------------------------------------------------------------------
    async def stats(self) -> EngineStats:
        """Fresh stats, taken on the engine thread after every command sent before this call
        (the last published ones once the engine thread has stopped)."""
        try:
            return await self.call(lambda engine: engine.stats())
        except EngineClosedError:
            return self.last_stats

    async def check_invariants(self) -> None:
        """Run the engine's block accounting check on the engine thread; raises if it fails."""
        await self.call(lambda engine: engine.check_invariants())

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread (between steps) and return its result."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._submit(_Call(fn, loop, future), allow_closed=True)
        return await future

    async def wait_idle(self) -> None:
        """Return once the engine has no unfinished request (counting every command sent before)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        try:
            self._submit(_IdleWaiter(loop, future), allow_closed=True)
        except EngineClosedError:
            return  # the engine thread stopped: nothing runs any more
        await future

    # ---- shutdown --------------------------------------------------------------------------------
    async def shutdown(self, timeout: float = 30.0) -> None:
        """Refuse new requests, let running ones finish for up to `timeout` seconds, abort the rest
        (their streams raise EngineClosedError) and stop the engine thread."""
        with self._lock:
            self._closed = True
        if self.is_healthy:
            try:
                await asyncio.wait_for(self.wait_idle(), timeout)
            except (asyncio.TimeoutError, EngineDeadError):
                pass
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop at once (thread-safe, blocking): abort whatever is running and join the engine thread."""
        with self._lock:
            self._closed = True
            stop_needed = self._dead is None
        if stop_needed and self._thread.is_alive():
            self._commands.put(_Stop())
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ---- caller side helpers -----------------------------------------------------------------------
    def _submit(self, command: _Command, counts_as_add: bool = False, allow_closed: bool = False) -> None:
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError(str(self._dead))
            if self._stopped:
                raise EngineClosedError("The engine has stopped.")
            if self._closed and not allow_closed:
                raise EngineClosedError("The server is shutting down and takes no new requests.")
            if counts_as_add:
                self._pending_adds += 1
            self._commands.put(command)

    # ================================================================================================
    # Everything below runs on the engine thread.
    # ================================================================================================
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - any crash must fail the callers, never hang them
            logger.exception("the engine thread crashed")
            self._die(exc)

    def _loop(self) -> None:
        engine = self._engine
        while True:
            if self._process_commands(block=not engine.has_unfinished_requests()):
                self._stop()
                return
            self._flush()  # acknowledge new requests before the (possibly long) step
            step = None
            if engine.has_unfinished_requests():
                steps_before = engine.num_steps
                self._handle_outputs(engine.step())
                step = engine.last_step if engine.num_steps != steps_before else None
            self._notify(step)
            self._publish()
            self._flush()

    def _process_commands(self, block: bool) -> bool:
        """Run every queued command (waiting for one first when `block`); True if told to stop."""
        if block:
            self._inbox.append(self._commands.get())
        self._take_queued()
        adds = 0
        try:
            while self._inbox:
                command = self._inbox.popleft()
                if isinstance(command, _Stop):
                    return True
                adds += isinstance(command, _Add)
                self._run_command(command)
        finally:
            if adds:
                with self._lock:
                    self._pending_adds -= adds
                    self._snapshot = self._engine.stats()
        return False

    def _take_queued(self) -> None:
        while True:
            try:
                self._inbox.append(self._commands.get_nowait())
            except queue.Empty:
                return

    def _run_command(self, command: _Command) -> None:
        if isinstance(command, _Add):
            self._do_add(command)
        elif isinstance(command, _Abort):
            self._do_abort(command.request_ids)
        elif isinstance(command, _Call):
            self._do_call(command)
        elif isinstance(command, _IdleWaiter):
            self._idle_waiters.append(command)

    def _do_add(self, command: _Add) -> None:
        sink = command.sink
        try:
            self._engine.add_request(
                sink.request_id,
                command.prompt_token_ids,
                command.params,
                command.priority,
                cache_salt=command.cache_salt,
            )
        except Exception as exc:  # InvalidRequestError mostly: the engine state is untouched
            self._deliver(sink.loop, sink.accept, exc)
            return
        self._live[sink.request_id] = sink
        self._deliver(sink.loop, sink.accept, None)

    def _do_abort(self, request_ids: list[str]) -> None:
        live = [r for r in request_ids if self._live.pop(r, None) is not None]
        if live:
            outputs = self._engine.abort_request(live)
            self.num_aborted += len(live)
            if self._listeners:
                self._round_outputs.extend(outputs)

    def _do_call(self, command: _Call) -> None:
        try:
            result = command.fn(self._engine)
        except Exception as exc:
            self._deliver(command.loop, _set_future, command.future, None, exc)
        else:
            self._deliver(command.loop, _set_future, command.future, result, None)

    def _handle_outputs(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            sink = self._live.get(output.request_id)
            if sink is None:
                continue
            if output.finished:
                del self._live[output.request_id]
                self.num_finished += 1
            self._deliver(sink.loop, sink.push, output)  # a snapshot the engine never touches again
            if self._listeners:
                self._round_outputs.append(output)

    def _notify(self, step: StepRecord | None) -> None:
        outputs, self._round_outputs = self._round_outputs, []
        if step is None and not outputs:
            return
        events = EngineEvents(step, outputs)
        for listener in self._listeners:
            try:
                listener(events)
            except Exception:  # a listener's bug must not stop the engine
                logger.exception("an engine event listener failed")

    def _publish(self) -> None:
        with self._lock:
            self._snapshot = self._engine.stats()
        if self._idle_waiters and not self._engine.has_unfinished_requests():
            for waiter in self._idle_waiters:
                self._deliver(waiter.loop, _set_future, waiter.future, None, None)
            self._idle_waiters.clear()

    def _deliver(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
        self._deliveries.setdefault(loop, []).append(lambda: fn(*args))

    def _flush(self) -> None:
        """Hand this round's deliveries to each event loop in one call_soon_threadsafe."""
        deliveries, self._deliveries = self._deliveries, {}
        for loop, calls in deliveries.items():
            try:
                loop.call_soon_threadsafe(_run_all, calls)
            except RuntimeError:  # that loop is closed: nobody is left to read its requests
                self._do_abort([r for r, sink in self._live.items() if sink.loop is loop])

    def _stop(self) -> None:
        """Abort every request (their callers get EngineClosedError) and answer pending waiters."""
        error = EngineClosedError("The request was aborted because the server is shutting down.")
        with self._lock:
            self._stopped = True
        self._fail_queued_commands(error)
        self._fail_everything(error)
        self._engine.abort_request(list(self._engine.requests))
        with self._lock:
            self._snapshot = self._engine.stats()
        for waiter in self._idle_waiters:
            self._deliver(waiter.loop, _set_future, waiter.future, None, None)
        self._idle_waiters.clear()
        self._flush()

    def _die(self, exc: BaseException) -> None:
        error = EngineDeadError(f"The engine failed: {exc!r}")
        with self._lock:
            self._dead = error
        self._fail_queued_commands(error)
        self._fail_everything(error)
        for waiter in self._idle_waiters:
            self._deliver(waiter.loop, _set_future, waiter.future, None, error)
        self._idle_waiters.clear()
        self._flush()

    def _fail_everything(self, error: BaseException) -> None:
        for sink in self._live.values():
            self._deliver(sink.loop, sink.push, error)
        self._live.clear()

    def _fail_queued_commands(self, error: BaseException) -> None:
        """After the stop or death flag is set no command can be queued: answer the ones that are."""
        self._take_queued()
        while self._inbox:
            command = self._inbox.popleft()
            if isinstance(command, _Add):
                self._deliver(command.sink.loop, command.sink.accept, error)
            elif isinstance(command, _Call):
                self._deliver(command.loop, _set_future, command.future, None, error)
            elif isinstance(command, _IdleWaiter):
                self._idle_waiters.append(command)


def _run_all(calls: list[Callable[[], None]]) -> None:
    for call in calls:
        call()


def _set_future(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
