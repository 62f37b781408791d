"""Latency targets (SLOs) and admission against them.

The estimator learns from the engine's recent steps how long a prompt token takes to prefill, and
predicts a new request's time to first token from the prefill work queued ahead of it. A request
that would miss the TTFT target is turned away at once (503 with Retry-After: the seconds the
backlog needs to drain) rather than joining a queue where it, and everyone after it, would be late.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmserve.engine.messages import StepRecord

_ALPHA = 0.2  # weight of the newest step in the moving averages
_MIN_PREFILL_TOKENS = 8  # steps with less prefill say little about its cost per token


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def enabled(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def met(self, ttft: float | None, tpot: float | None) -> bool:
        """Whether a finished request met every target that is set (seconds in, milliseconds set)."""
        if self.ttft_ms is not None and (ttft is None or ttft * 1000 > self.ttft_ms):
            return False
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms


class LoadEstimator:
    """Moving averages of step costs: seconds per prefill token and seconds per decode-only step."""

    def __init__(self) -> None:
        self.seconds_per_prefill_token: float | None = None
        self.decode_step_seconds: float | None = None

    def observe(self, step: StepRecord) -> None:
        if step.num_prefill_tokens >= _MIN_PREFILL_TOKENS:
            self.seconds_per_prefill_token = _ewma(self.seconds_per_prefill_token, step.duration / step.num_tokens)
        elif step.num_prefill_tokens == 0:
            self.decode_step_seconds = _ewma(self.decode_step_seconds, step.duration)

    def predict_ttft(self, queued_prefill_tokens: int, prompt_tokens: int) -> float | None:
        """Seconds until a request with `prompt_tokens` gets its first token; None before any data."""
        if self.seconds_per_prefill_token is None:
            return None
        return (queued_prefill_tokens + prompt_tokens) * self.seconds_per_prefill_token

    def retry_after(self, predicted: float, target_seconds: float) -> int:
        """Whole seconds (at least 1) until the backlog shrinks enough for the target to be met."""
        return max(1, math.ceil(predicted - target_seconds))


def _ewma(previous: float | None, value: float) -> float:
    return value if previous is None else (1 - _ALPHA) * previous + _ALPHA * value
