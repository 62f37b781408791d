"""What every endpoint shares: the engine client, the served model's names, admission control."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fastapi import Request

from llmserve.engine.async_llm import AsyncLLM
from llmserve.server import errors
from llmserve.server.logprobs import TokenTexts
from llmserve.server.metrics import Telemetry
from llmserve.server.protocol import now


@dataclass
class ServerState:
    engine: AsyncLLM
    served_model_name: str
    model_aliases: tuple[str, ...] = ()  # other names a request may use (e.g. the --model path)
    model_root: str | None = None
    max_waiting_requests: int = 1024
    draining: bool = False  # set on SIGTERM: new requests get a 503
    telemetry: Telemetry | None = None
    created: int = field(default_factory=now)
    token_texts: TokenTexts = field(init=False)

    def __post_init__(self) -> None:
        self.token_texts = TokenTexts(self.engine.tokenizer)

    def check_model(self, model: str | None) -> None:
        """Raise a 404 unless `model` is unset or names the served model."""
        if model is not None and model != self.served_model_name and model not in self.model_aliases:
            raise errors.model_not_found(model)

    def admit(self, prompts: Sequence[str | Sequence[int]] = ("",)) -> None:
        """Admission control: refuse with 503 when draining, when the waiting queue is full, or when
        the TTFT target (--slo-ttft-ms) cannot be met at the current load."""
        if self.draining or not self.engine.is_accepting:
            if self.engine.dead_error is not None:
                raise errors.from_exception(self.engine.dead_error)
            raise errors.shutting_down()
        waiting = self.engine.num_waiting
        if waiting + len(prompts) > self.max_waiting_requests:
            self._reject("queue_full")
            raise errors.overloaded(
                f"The server has {waiting} requests waiting (limit {self.max_waiting_requests}); retry later."
            )
        self._check_ttft_slo(prompts)

    def _check_ttft_slo(self, prompts: Sequence[str | Sequence[int]]) -> None:
        telemetry = self.telemetry
        if telemetry is None or telemetry.slo.ttft_ms is None:
            return
        telemetry.drain()
        prompt_tokens = sum(self._num_tokens(p) for p in prompts)
        queued = self.engine.last_stats.num_pending_prefill_tokens
        predicted = telemetry.estimator.predict_ttft(queued, prompt_tokens)
        target = telemetry.slo.ttft_ms / 1000
        if predicted is None or predicted <= target:
            return
        self._reject("slo_ttft")
        raise errors.overloaded(
            f"The server cannot meet its time-to-first-token target of {telemetry.slo.ttft_ms:g} ms now "
            f"(estimated {predicted * 1000:.0f} ms); retry later.",
            retry_after=telemetry.estimator.retry_after(predicted, target),
        )

    def _num_tokens(self, prompt: str | Sequence[int]) -> int:
        return len(self.engine.tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)

    def _reject(self, reason: str) -> None:
        if self.telemetry is not None:
            self.telemetry.reject(reason)


def get_state(request: Request) -> ServerState:
    return request.app.state.llmserve
