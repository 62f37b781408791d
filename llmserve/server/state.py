"""What every endpoint shares: the engine client, the served model's names, admission control."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from llmserve.engine.async_llm import AsyncLLM
from llmserve.server import errors
from llmserve.server.logprobs import TokenTexts
from llmserve.server.protocol import now


@dataclass
class ServerState:
    engine: AsyncLLM
    served_model_name: str
    model_aliases: tuple[str, ...] = ()  # other names a request may use (e.g. the --model path)
    model_root: str | None = None
    max_waiting_requests: int = 1024
    draining: bool = False  # set on SIGTERM: new requests get a 503
    created: int = field(default_factory=now)
    token_texts: TokenTexts = field(init=False)

    def __post_init__(self) -> None:
        self.token_texts = TokenTexts(self.engine.tokenizer)

    def check_model(self, model: str | None) -> None:
        """Raise a 404 unless `model` is unset or names the served model."""
        if model is not None and model != self.served_model_name and model not in self.model_aliases:
            raise errors.model_not_found(model)

    def admit(self, num_requests: int = 1) -> None:
        """Admission control: refuse with 503 when draining or when the waiting queue is full."""
        if self.draining or not self.engine.is_accepting:
            if self.engine.dead_error is not None:
                raise errors.from_exception(self.engine.dead_error)
            raise errors.shutting_down()
        waiting = self.engine.num_waiting
        if waiting + num_requests > self.max_waiting_requests:
            raise errors.overloaded(
                f"The server has {waiting} requests waiting (limit {self.max_waiting_requests}); retry later."
            )


def get_state(request: Request) -> ServerState:
    return request.app.state.llmserve
