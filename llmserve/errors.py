"""Exceptions the engine raises (bad input, a dead or closing engine); the server maps them to
OpenAI-shaped errors."""

from __future__ import annotations


class LLMServeError(Exception):
    """Base class for every error llmserve raises on purpose."""


class InvalidRequestError(LLMServeError, ValueError):
    """A request the engine cannot run as given. `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ContextLengthExceededError(InvalidRequestError):
    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")


class EngineDeadError(LLMServeError):
    """The engine core died; its requests failed. A new core may be on its way (see `is_healthy`)."""


class EngineClosedError(LLMServeError):
    """The engine is shutting down: it takes no new requests, or it stopped this one."""


class ModelLoadError(LLMServeError):
    """The model could not be found, downloaded or read."""


class UnsupportedArchitectureError(ModelLoadError):
    pass
