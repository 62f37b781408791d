"""A live OpenAI-compatible server over the tiny model, in this process: uvicorn on a free
127.0.0.1 port in a background thread, so tests can reach both HTTP and the engine client."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import openai
import pytest
from fastapi import FastAPI

from llmserve.config import EngineConfig
from llmserve.engine.async_llm import AsyncLLM
from llmserve.engine.messages import EngineStats
from llmserve.server.app import build_app
from llmserve.server.graceful import GracefulServer

T = TypeVar("T")

MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 512
MAX_NUM_BATCHED_TOKENS = 64
NUM_KV_BLOCKS = 512


@dataclass
class LiveServer:
    base_url: str  # http://127.0.0.1:PORT
    engine: AsyncLLM
    app: FastAPI
    loop: asyncio.AbstractEventLoop  # the server's, which the engine client lives on
    model: str = MODEL_NAME

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="x", max_retries=0, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="x", max_retries=0, **kwargs)

    def ask(self, question: Callable[[AsyncLLM], Awaitable[T]]) -> T:
        """Ask the engine (its core, over its interface) on the server's loop; blocks for the answer."""
        return asyncio.run_coroutine_threadsafe(question(self.engine), self.loop).result(timeout=120)

    async def ask_async(self, question: Callable[[AsyncLLM], Awaitable[T]]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(question(self.engine), self.loop))

    def idle_stats(self) -> EngineStats:
        """Wait (without sleeping) until the engine core has nothing left to run, check its block
        accounting, and return its fresh stats."""
        return self.ask(idle_stats)


async def idle_stats(engine: AsyncLLM) -> EngineStats:
    await engine.wait_idle()
    await engine.check_invariants()
    return await engine.stats()


def start_server(app: FastAPI) -> tuple[GracefulServer, threading.Thread, str, asyncio.AbstractEventLoop]:
    import uvicorn

    listening = threading.Event()
    address: list[str] = []
    loops: list[asyncio.AbstractEventLoop] = []

    def on_listening(host: str, port: int) -> None:
        address.append(f"http://{host}:{port}")
        loops.append(asyncio.get_running_loop())
        listening.set()

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=5)
    server = GracefulServer(config, on_signal=lambda: None, on_listening=on_listening)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    if not listening.wait(timeout=60):
        raise RuntimeError("the test server did not start")
    return server, thread, address[0], loops[0]


@contextmanager
def app_serving(app: FastAPI) -> Iterator[str]:
    """`app` served on a free port in a thread of this process, for the block; its base URL."""
    server, thread, base_url, _ = start_server(app)
    try:
        yield base_url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def tiny_engine_running(
    model_dir, num_kv_blocks: int, max_num_batched_tokens: int, max_model_len: int = MAX_MODEL_LEN
) -> Iterator[AsyncLLM]:
    """The tiny model's engine in float32, its core process with one intra-op thread: on a shared
    2-core machine OpenMP's spinning threads make step times erratic."""
    with one_thread_engine_cores():
        engine = AsyncLLM.from_config(
            EngineConfig(
                model=str(model_dir),
                dtype="float32",
                num_kv_blocks=num_kv_blocks,
                max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens,
            )
        )
    try:
        yield engine
    finally:
        engine.close()


@contextmanager
def one_thread_engine_cores() -> Iterator[None]:
    """Engine core processes started meanwhile use one OpenMP thread (they read it at start)."""
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = previous


@contextmanager
def serving(model_dir, max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS, max_model_len: int = MAX_MODEL_LEN,
            **app_options) -> Iterator[LiveServer]:
    """`model_dir`'s engine served as MODEL_NAME (`app_options` go to `build_app`)."""
    with tiny_engine_running(model_dir, NUM_KV_BLOCKS, max_num_batched_tokens, max_model_len) as engine:
        app = build_app(engine, MODEL_NAME, model_root=str(model_dir), **app_options)
        server, thread, base_url, loop = start_server(app)
        try:
            yield LiveServer(base_url=base_url, engine=engine, app=app, loop=loop)
        finally:
            server.should_exit = True
            thread.join(timeout=30)


@contextmanager
def serving_config(config: EngineConfig, name: str) -> Iterator[LiveServer]:
    """An engine of `config` (its core with one intra-op thread) served as `name`."""
    with one_thread_engine_cores():
        engine = AsyncLLM.from_config(config)
    app = build_app(engine, name, model_root=config.model)
    server, thread, base_url, loop = start_server(app)
    try:
        yield LiveServer(base_url, engine, app, loop, model=name)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        engine.close()


@pytest.fixture(scope="module")
def live_server(tiny_llama_dir) -> Iterator[LiveServer]:
    with serving(tiny_llama_dir, max_waiting_requests=1024) as server:
        yield server
