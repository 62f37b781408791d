"""The front end's handle on one engine core process: starting it, the two ZeroMQ sockets to it
(requests in, step outputs out), its handshake, and stopping it.

Each core gets two fresh IPC paths, which it binds and the front end connects to, so a replacement
core (after a crash) never sees a message meant for the one before it.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import tempfile
import threading
import uuid
from multiprocessing.connection import wait as wait_for_handles
from pathlib import Path

import msgspec
import zmq

from llmserve.config import EngineConfig
from llmserve.engine.core_bootstrap import run_in_environment
from llmserve.engine.core_proc import run_engine_core
from llmserve.engine.messages import (
    EngineCoreDead,
    EngineCoreInput,
    EngineCoreMessage,
    EngineCoreReady,
    Shutdown,
)
from llmserve.engine.model_facts import ModelFacts
from llmserve.errors import LLMServeError

logger = logging.getLogger(__name__)

_POLL_MS = 100


class EngineCoreStartError(LLMServeError):
    """The engine core process failed before it was ready."""


class EngineCoreProcess:
    def __init__(self, config: EngineConfig, facts: ModelFacts) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="llmserve-"))
        name = uuid.uuid4().hex[:8]
        input_address, output_address = f"ipc://{self._dir / name}-in", f"ipc://{self._dir / name}-out"
        self._context = zmq.Context()
        # Connected, not bound: a connecting socket queues what it sends until the core's end exists.
        self.input_socket = self._connect(zmq.PUSH, input_address)
        self.output_socket = self._connect(zmq.PULL, output_address)
        self._send_lock = threading.Lock()  # aborts may come from garbage-collection finalizers
        self._encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineCoreMessage)
        call = (run_engine_core, (config, facts, input_address, output_address, logging.getLogger().getEffectiveLevel()))
        self.process = _forkserver().Process(
            target=run_in_environment,
            args=(_core_environment(), pickle.dumps(call)),
            name="llmserve-engine-core",
            daemon=True,
        )
        self.process.start()
        self.ready: EngineCoreReady | None = None
        self._closed = False

    def _connect(self, kind: int, address: str) -> zmq.Socket:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, 0)  # no limit: a burst of requests never blocks the server
        socket.setsockopt(zmq.RCVHWM, 0)
        socket.setsockopt(zmq.RECONNECT_IVL, 10)  # the core binds in a moment: retry soon
        socket.connect(address)
        return socket

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def wait_ready(self) -> EngineCoreReady:
        """Block until the core has loaded its model; EngineCoreStartError if it failed instead."""
        poller = zmq.Poller()
        poller.register(self.output_socket, zmq.POLLIN)
        while True:
            if poller.poll(_POLL_MS):
                message = self.decoder.decode(self.output_socket.recv())
                if isinstance(message, EngineCoreReady):
                    self.ready = message
                    return message
                if isinstance(message, EngineCoreDead):
                    self.close()
                    raise EngineCoreStartError(message.error)
            elif not self.process.is_alive():
                self.close()
                raise EngineCoreStartError(f"the engine core process exited with status {self.process.exitcode}")

    def send(self, message: EngineCoreInput) -> None:
        """Queue a message to the core (thread-safe; never blocks on the core; dropped once closed)."""
        data = self._encoder.encode(message)
        with self._send_lock:
            if not self._closed:
                self.input_socket.send(data, copy=False)

    def shutdown(self, timeout: float) -> None:
        """Ask the core to stop, wait up to `timeout` seconds for it, then kill it."""
        if self.process.is_alive():
            try:
                self.send(Shutdown())
            except zmq.ZMQError:
                pass
            wait_for_handles([self.process.sentinel], timeout)
        self.close()

    def close(self) -> None:
        """Kill the process if it still runs, reap it, and release the sockets (once)."""
        if self._closed:
            return
        self._closed = True
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        with self._send_lock:
            self.input_socket.close()
            self.output_socket.close()
            self._context.term()
        for path in self._dir.iterdir():
            path.unlink(missing_ok=True)
        os.rmdir(self._dir)


_FORKSERVER_START = threading.Lock()


def _forkserver() -> multiprocessing.context.ForkServerContext:
    """Cores fork from multiprocessing's forkserver, started with the first and loaded with torch (core_preload):
    a core then starts 1.5 s sooner than one spawned afresh on a CPU, and ends without tearing an interpreter
    down (measured in BENCHMARKS.md), which a restart after a crash and every test's engine wait for.

    It starts with OMP_WAIT_POLICY=PASSIVE (unless the user chose a policy), which its OpenMP reads once, when it
    loads torch, and so its cores' too; the variable is set only meanwhile, and one thread at a time sets it:
    `serve` loads its models on threads at once."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["llmserve.engine.core_preload"])
    with _FORKSERVER_START:
        if "OMP_WAIT_POLICY" in os.environ:
            multiprocessing.forkserver.ensure_running()
            return context
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            del os.environ["OMP_WAIT_POLICY"]
    return context


def _core_environment() -> dict[str, str]:
    """The front end's environment, for the core to take on (core_bootstrap), with OpenMP's threads waiting
    passively unless the user chose otherwise: on a CPU the core and this process share the cores, and spinning
    intra-op threads took the front end's core (a host-bound model served at half speed), while a single thread
    left a compute-bound one 35% slower; passive threads keep both (measured in BENCHMARKS.md). The core's own
    OpenMP was loaded so by the forkserver; the variable is for the processes the core starts (its
    tensor-parallel workers)."""
    return {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}
