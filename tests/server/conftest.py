"""A live OpenAI-compatible server over the tiny model, in this process: uvicorn on a free
127.0.0.1 port in a background thread, so tests can reach both HTTP and the engine client."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import openai
import pytest
import torch
from fastapi import FastAPI

from llmserve.config import EngineConfig
from llmserve.engine.async_llm import AsyncLLM
from llmserve.engine.llm_engine import EngineStats
from llmserve.server.app import build_app
from llmserve.server.serve import GracefulServer

MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 512
MAX_NUM_BATCHED_TOKENS = 64
NUM_KV_BLOCKS = 512


@dataclass
class LiveServer:
    base_url: str  # http://127.0.0.1:PORT
    engine: AsyncLLM
    app: FastAPI
    model: str = MODEL_NAME

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="x", max_retries=0, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="x", max_retries=0, **kwargs)

    def idle_stats(self) -> EngineStats:
        """Wait (without sleeping) until the engine has nothing left to run, then return fresh stats."""

        async def wait() -> EngineStats:
            await self.engine.wait_idle()
            await self.engine.check_invariants()
            return await self.engine.stats()

        return asyncio.run(wait())


def start_server(app: FastAPI) -> tuple[GracefulServer, threading.Thread, str]:
    import uvicorn

    listening = threading.Event()
    address: list[str] = []

    def on_listening(host: str, port: int) -> None:
        address.append(f"http://{host}:{port}")
        listening.set()

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=5)
    server = GracefulServer(config, on_signal=lambda: None, on_listening=on_listening)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    if not listening.wait(timeout=60):
        raise RuntimeError("the test server did not start")
    return server, thread, address[0]


@contextmanager
def tiny_engine_running(model_dir, num_kv_blocks: int, max_num_batched_tokens: int) -> Iterator[AsyncLLM]:
    """The tiny model's engine in float32, with one intra-op thread while it runs: on a shared 2-core
    machine OpenMP's spinning threads make step times erratic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = AsyncLLM.from_config(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            num_kv_blocks=num_kv_blocks,
            max_model_len=MAX_MODEL_LEN,
            max_num_batched_tokens=max_num_batched_tokens,
        )
    )
    try:
        yield engine
    finally:
        engine.close()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def live_server(tiny_llama_dir) -> Iterator[LiveServer]:
    with tiny_engine_running(tiny_llama_dir, NUM_KV_BLOCKS, MAX_NUM_BATCHED_TOKENS) as engine:
        app = build_app(engine, MODEL_NAME, model_root=str(tiny_llama_dir), max_waiting_requests=1024)
        server, thread, base_url = start_server(app)
        try:
            yield LiveServer(base_url=base_url, engine=engine, app=app)
        finally:
            server.should_exit = True
            thread.join(timeout=30)
