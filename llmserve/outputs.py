"""What the engine hands back for a request: vLLM's `RequestOutput` / `CompletionOutput` shapes, and
`EmbeddingRequestOutput` for an embedding request."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(slots=True)
class Logprob:
    """One token's log probability under the raw logits (vLLM's shape): its rank among the whole
    vocabulary (1 = the most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: the token at that position and the top alternatives, each with its `Logprob`.
SampleLogprobs = list[dict[int, Logprob]]
# The prompt's: None for its first token (nothing precedes it), then as `SampleLogprobs`.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: SampleLogprobs | None = None  # per token: chosen token and top alternatives
    cumulative_logprob: float | None = None
    # With SamplingParams.track_text_ends: per token whose text is out, the length of `text` then
    text_ends: list[int] | None = None
    # With SamplingParams.prediction: its tokens the model was given to verify and took, and those it did not
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def tokens_within(self, length: int) -> int:
        """How many leading tokens produced text only within `text[:length]` (all of them when the
        text ends are not tracked)."""
        if self.text_ends is None:
            return len(self.token_ids)
        return bisect.bisect_right(self.text_ends, length)


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (time.monotonic seconds) the engine records as the request moves along."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    def snapshot(self) -> RequestMetrics:
        return RequestMetrics(self.arrival_time, self.first_scheduled_time, self.first_token_time,
                              self.last_token_time, self.finished_time, self.num_preemptions)

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # when SamplingParams.prompt_logprobs asked for them
    # disaggregation's prefill side, when finished: where its prompt's KV waits (vLLM's kv_transfer_params)
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    """One input's embedding (vLLM's shape); `data` holds it as float32 values."""

    data: np.ndarray

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    @property
    def hidden_size(self) -> int:
        return len(self.data)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What an embedding request returns (vLLM's `EmbeddingRequestOutput`): one output, at its end."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    metrics: RequestMetrics
    finished: bool = True


@dataclass(slots=True)
class ClassificationOutput:
    """One input's label probabilities (vLLM's shape), in the order of the model's labels."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ClassificationRequestOutput:
    """What `LLM.classify` returns per input (vLLM's `ClassificationRequestOutput`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True


@dataclass(slots=True)
class ScoringOutput:
    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """What `LLM.score` returns per text pair (vLLM's `ScoringRequestOutput`); a cross-encoder's tokens are the
    pair's, a bi-encoder's the two texts' one after the other."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
