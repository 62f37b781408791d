"""`llmserve serve`: the engine, the app and uvicorn, with a graceful shutdown on SIGTERM.

SIGTERM (or Ctrl+C): new requests get a 503 at once, uvicorn stops listening, in-flight requests
run to completion for up to --shutdown-timeout seconds (then they are cancelled, which aborts
them), the engine stops, and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import uvicorn

from llmserve.config import EngineConfig
from llmserve.engine.async_llm import AsyncLLM
from llmserve.server.app import build_app
from llmserve.server.slo import SLO

logger = logging.getLogger(__name__)

DEFAULT_SERVED_NAME = "llmserve-default"
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    """uvicorn.Server that drains on SIGINT/SIGTERM and then returns normally (exit status 0)
    instead of re-raising the signal, and reports its address once it listens."""

    def __init__(
        self, config: uvicorn.Config, on_signal: Callable[[], None], on_listening: Callable[[str, int], None]
    ) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        self._on_listening = on_listening

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._handle_signal) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _handle_signal(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl+C: stop waiting for in-flight requests
        self.should_exit = True
        self._on_signal()

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        servers = getattr(self, "servers", [])
        if self.started and servers and servers[0].sockets:
            host, port = servers[0].sockets[0].getsockname()[:2]
            self._on_listening(host, port)


def served_name(model_arg: str | None) -> str:
    """The default model name: "llmserve-default" for the built-in model, a local directory's name,
    or the hub id as given."""
    if model_arg is None:
        return DEFAULT_SERVED_NAME
    path = Path(model_arg).expanduser()
    return path.resolve().name if path.is_dir() else model_arg


def resolve_model(model_arg: str | None) -> str:
    if model_arg is not None:
        return model_arg
    from llmserve.model.builtin import DEFAULT_ARCH, DEFAULT_SIZE, ensure_default_model

    return str(ensure_default_model(DEFAULT_ARCH, DEFAULT_SIZE))


def run_server(args: argparse.Namespace) -> int:
    from llmserve.cli import engine_kwargs

    model = resolve_model(args.model)
    name = args.served_model_name or served_name(args.model)
    engine = AsyncLLM.from_config(EngineConfig(model=model, served_model_name=name, **engine_kwargs(args)))
    app = build_app(
        engine,
        name,
        model_aliases=[args.model] if args.model else [],
        model_root=model,
        max_waiting_requests=args.max_waiting_requests,
        owns_engine=True,
        shutdown_timeout=args.shutdown_timeout,
        slo=SLO(args.slo_ttft_ms, args.slo_tpot_ms),
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=args.shutdown_timeout,
        timeout_keep_alive=5,
    )
    state = app.state.llmserve

    def on_signal() -> None:
        state.draining = True
        _announce("llmserve: shutting down, finishing in-flight requests")

    def on_listening(host: str, port: int) -> None:
        _announce(f"llmserve: serving {name} at http://{host}:{port}/v1")

    try:
        asyncio.run(GracefulServer(config, on_signal, on_listening).serve())
    finally:
        engine.close(timeout=args.shutdown_timeout)
    return 0


def _announce(message: str) -> None:
    # May run inside a signal handler: one unbuffered write, no logging locks.
    os.write(sys.stdout.fileno(), (message + "\n").encode())
