"""llmserve: a paged-KV inference engine, an OpenAI-compatible server and the platform around them."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "llmserve.llm",
    "LLMEngine": "llmserve.engine.llm_engine",
    "EngineConfig": "llmserve.config",
    "SamplingParams": "llmserve.sampling.params",
    "RequestOutput": "llmserve.outputs",
    "CompletionOutput": "llmserve.outputs",
    "LoRARequest": "llmserve.model.lora_request",
}

__all__ = [
    "LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "LoRARequest", "__version__",
]

if TYPE_CHECKING:
    from llmserve.config import EngineConfig
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.llm import LLM
    from llmserve.model.lora_request import LoRARequest
    from llmserve.outputs import CompletionOutput, RequestOutput
    from llmserve.sampling.params import SamplingParams


def __getattr__(name: str):
    # Imported on first use, so `llmserve make-model` or the server's protocol models don't pay for torch.
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'llmserve' has no attribute {name!r}")
