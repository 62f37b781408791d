"""The engine core's own process (vLLM v1's `EngineCoreProc`): a busy loop that takes requests,
aborts and utility calls from the front end over ZeroMQ, runs engine steps while there is work, and
sends one message per step back. With nothing to step it sleeps on its input socket, and on the wakeup
pipes of work done off the loop while requests wait for their grammar to compile or their prompt's KV to
be pulled (never polling); while it holds KV for another engine to pull (disaggregation), only until
that is due to be let go. The front end starts it (`core_client`), and it never outlives the front end:
when the parent process is gone, it exits.

A failure, at start or in a step, is reported with a last `EngineCoreDead` message before the
process exits with a non-zero status; the front end fails what was in flight and starts a new one.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from llmserve.config import EngineConfig
from llmserve.engine.messages import (
    AbortRequests,
    EngineCoreDead,
    EngineCoreInput,
    EngineCoreOutputs,
    EngineCoreReady,
    EngineCoreRequest,
    Shutdown,
    StopChoices,
    UtilityCall,
    UtilityResult,
)
from llmserve.engine.model_facts import ModelFacts
from llmserve.plugins import load_plugins

if TYPE_CHECKING:  # the core's modules (the model, torch) load in its own process only
    from llmserve.engine.core import EngineCore

logger = logging.getLogger(__name__)

# What the front end may call between steps (`UtilityCall.method`); wait_idle answers once idle, and
# reload_weights once the new weights, read on a thread while steps go on, are in place.
UTILITY_METHODS = ("stats", "check_invariants", "wait_idle", "reload_weights", "reset_prefix_cache")


class EngineCoreProc:
    def __init__(self, core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self._decoder = msgspec.msgpack.Decoder(EngineCoreInput)
        self._encoder = msgspec.msgpack.Encoder()
        self._idle_waiters: list[int] = []
        self._reloads: list[tuple[int, str, Future]] = []  # (call id, model dir, weights being read)
        self._changed = False  # a message changed the core's state since the last step
        self._wakeup_poller: zmq.Poller | None = None
        self._handlers: dict[type, Callable[[Any], None]] = {
            EngineCoreRequest: core.add_request,
            AbortRequests: lambda message: core.abort_requests(message.request_ids),
            StopChoices: lambda message: core.stop_choices(message.choices),
            UtilityCall: self._call,
        }

    def run(self) -> None:
        """Serve until told to shut down."""
        while True:
            self._changed = False
            if self._take_inputs(block=not self.core.can_step() and not self._reloads):
                return
            if self.core.release_kv_exports():
                self._changed = True
            if self.core.can_step():
                outputs = self.core.step()
                if outputs is not None:
                    self._send(outputs)
            elif self._changed:  # e.g. the last request aborted: no step will report it
                self._send(EngineCoreOutputs([], None, self.core.stats()))
            if self._reloads:
                self._swap_read_weights(wait=not self.core.can_step())
            if self._idle_waiters and not self.core.has_work():
                for call_id in self._idle_waiters:
                    self._send(UtilityResult(call_id))
                self._idle_waiters.clear()

    def _take_inputs(self, block: bool) -> bool:
        """Handle every message waiting (waiting for one first when `block`); True on shutdown. While
        requests wait for their grammar, a blocking wait also ends when a compile completes."""
        if block and (self.core.has_work() or self.core.seconds_to_next_kv_expiry() is not None):
            self._wait_for_input_or_wakeup()
            block = False
        flags = 0 if block else zmq.NOBLOCK
        while True:
            try:
                message = self._decoder.decode(self.inputs.recv(flags, copy=False).buffer)
            except zmq.Again:
                return False
            if isinstance(message, Shutdown):
                return True
            self._changed = True
            self._handlers[type(message)](message)
            flags = zmq.NOBLOCK

    def _wait_for_input_or_wakeup(self) -> None:
        """Sleep until a message comes, work off the loop completes (a grammar, a KV pull or serve), or
        held KV is due to be let go."""
        expiry = self.core.seconds_to_next_kv_expiry()
        self._poller.poll(None if expiry is None else int(expiry * 1000) + 1)
        self.core.clear_wakeups()

    @property
    def _poller(self) -> zmq.Poller:
        if self._wakeup_poller is None:
            self._wakeup_poller = zmq.Poller()
            self._wakeup_poller.register(self.inputs, zmq.POLLIN)
            for fd in self.core.wakeup_fds:
                self._wakeup_poller.register(fd, zmq.POLLIN)
        return self._wakeup_poller

    def _call(self, call: UtilityCall) -> None:
        if call.method not in UTILITY_METHODS:
            self._send(UtilityResult(call.call_id, error=f"unknown utility method {call.method!r}"))
        elif call.method == "wait_idle":
            self._idle_waiters.append(call.call_id)
        elif call.method == "reload_weights":
            model_dir = str(call.args[0])
            self._reloads.append((call.call_id, model_dir, self.core.read_weights(model_dir)))
        else:
            try:
                result = getattr(self.core, call.method)(*call.args)
            except Exception as exc:
                self._send(UtilityResult(call.call_id, error=repr(exc)))
            else:
                self._send(UtilityResult(call.call_id, result))

    def _swap_read_weights(self, wait: bool) -> None:
        """Between two steps: put in place the weights whose reading finished (waiting for it when
        there is nothing to step), and answer their calls."""
        pending = []
        for call_id, model_dir, future in self._reloads:
            if not wait and not future.done():
                pending.append((call_id, model_dir, future))
                continue
            try:
                forgotten = self.core.swap_weights(model_dir, future.result())
            except Exception as exc:
                self._send(UtilityResult(call_id, error=str(exc)))
            else:
                self._send(UtilityResult(call_id, forgotten))
        self._reloads = pending

    def _send(self, message: msgspec.Struct) -> None:
        self.outputs.send(self._encoder.encode(message), copy=False)


def run_engine_core(config: EngineConfig, facts: ModelFacts, input_address: str, output_address: str,
                    log_level: int) -> None:
    """The process's entry point: connect, build the core, announce it, serve; report any failure."""
    _exit_with_parent()
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine core]: %(message)s")
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.setsockopt(zmq.RCVHWM, 0)
    inputs.bind(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)  # let the last word go out before the process ends
    outputs.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow front end
    outputs.bind(output_address)
    encoder = msgspec.msgpack.Encoder()
    try:
        load_plugins()
        # Imported here: the front end that starts this process needs none of the core's modules.
        from llmserve.engine.core import EngineCore

        core = EngineCore(config, facts)
        outputs.send(encoder.encode(EngineCoreReady(os.getpid(), core.runner.num_blocks)))
        EngineCoreProc(core, inputs, outputs).run()
        core.shutdown()
        outputs.send(encoder.encode(EngineCoreOutputs([], None, core.stats())))  # all freed: the last word
    except BaseException as exc:  # noqa: BLE001 - whatever it is, the front end must hear of it
        logger.exception("the engine core failed")
        outputs.send(encoder.encode(EngineCoreDead(f"{type(exc).__name__}: {exc}")))
        outputs.close()
        context.term()
        sys.exit(1)
    outputs.close()
    inputs.close(linger=0)
    context.term()


def _exit_with_parent() -> None:
    """Exit at once when the front end's process ends, however it ends (even `kill -9`): a thread
    waits on the parent's sentinel, which becomes ready when the parent is gone."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="llmserve-parent-watch", daemon=True).start()
