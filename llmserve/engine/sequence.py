"""The engine core's view of a request and the sequences it generates (n > 1 forks one per choice).

Token ids only: text, stop strings and logprob assembly live in the front end's output processor.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmserve.model.lora_request import LoRARequest
from llmserve.model.pooling import PoolingParams
from llmserve.multimodal.inputs import ImageInput
from llmserve.sampling.params import SamplingParams

if TYPE_CHECKING:
    import numpy as np

    from llmserve.engine.grammar import GrammarState
    from llmserve.engine.thinking import ThinkingBudget

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One stream of tokens with its KV blocks.

    `num_computed_tokens` counts the tokens whose KV is computed or scheduled to be (the scheduler
    advances it when it schedules a step, as vLLM v1 does). `num_pending` counts tokens sampled by
    steps still in flight: they exist but their ids have not reached the host (overlapped scheduling).
    """

    def __init__(self, request: Request, index: int, token_ids: list[int], num_prompt_tokens: int, seed: int) -> None:
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.num_computed_tokens = 0
        self.num_pending = 0
        self.pending_sample_row = -1  # the sampling row of the last launched step that samples for it
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # content names of its first full blocks (prefix caching)
        self.num_registered_blocks = 0  # leading blocks of block_table already named in the cache
        self.num_cached_tokens = 0  # tokens reused from the prefix cache at its latest admission
        self.times_overtaken = 0  # admissions of later sequences with a longer cached prefix
        self.status = SequenceStatus.WAITING
        self.seed = seed
        # Speculative decoding: its next draft's length at most (0: as configured), the steps it still goes
        # without drafting, and its drafts in a row with nothing accepted (the scheduler's).
        self.draft_limit = 0
        self.draft_pause = 0
        self.draft_misses = 0
        self.prediction_cursor = 0  # where in its request's prediction its output ends, as last found
        self.num_draft_tokens = 0  # drafts it had verified, and how many of them it took
        self.num_accepted_drafts = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        # Structured output, a thinking budget: where this sequence is in its grammar or its reasoning (advanced by
        # the scheduler as its tokens are appended); None without either.
        self.grammar: GrammarState | ThinkingBudget | None = (
            request.new_grammar() if request.new_grammar is not None else None)

    @property
    def num_tokens(self) -> int:
        """Tokens whose ids the host knows."""
        return len(self.token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def cache_root(self) -> bytes:
        return self.request.cache_root

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sort_key(self) -> tuple[int, int, int]:
        """Scheduling order: priority (lower first), then arrival, then choice index."""
        return (self.request.priority, self.request.arrival_order, self.index)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request.request_id}, tokens={self.num_tokens}+{self.num_pending}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table}, {self.status.value})"
        )


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_order: int
    priority: int = 0
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False
    cache_root: bytes = b""  # the prefix cache namespace: model identity and the request's cache_salt
    num_cached_tokens: int | None = None  # prompt tokens reused at first admission
    first_scheduled_time: float | None = None  # time.monotonic() of its first admission
    num_preemptions: int = 0
    min_tokens_banned: tuple[int, ...] | None = None  # what would end it early: banned until min_tokens
    allowed_mask: np.ndarray | None = None  # allowed_token_ids as a packed bitmask row, built at its first sample
    # structured output, a thinking budget: a fresh sequence's grammar state or reasoning section
    new_grammar: Callable[[], GrammarState | ThinkingBudget] | None = None
    # Prompt positions (from 0) whose next prompt token a scheduled step scores (prompt_logprobs).
    num_prompt_positions_scored: int = 0
    # An embedding request: its prompt is computed whole in one step, pooled, and it ends there.
    pooling: PoolingParams | None = None
    lora: LoRARequest | None = None  # the LoRA adapter it generates with
    export_kv: bool = False  # disaggregation's prefill side: its prompt's KV is kept for another engine when it ends
    num_imported_tokens: int = 0  # disaggregation's decode side: prompt tokens whose KV another engine computed
    prediction: np.ndarray | None = None  # the predicted output's tokens (Predicted Outputs): drafts to verify
    images: list[ImageInput] = field(default_factory=list)  # what its prompt's image placeholders stand for

    def __post_init__(self) -> None:
        # How far positions lag indexes after its images (Qwen2-VL's M-RoPE moves them on by their grids' longer
        # sides); 0 for every other model. Never positive: an image spans no more positions than it has tokens.
        self.position_lag = sum(image.shift for image in self.images)
        self.images_end = self.images[-1].offset + self.images[-1].length if self.images else 0

    @property
    def lora_id(self) -> int:
        """Its adapter's id; 0 without one."""
        return self.lora.lora_int_id if self.lora is not None else 0

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt tokens are still to be scored: its prompt must be computed, not read from the cache."""
        return (
            self.params.prompt_logprobs is not None
            and self.num_prompt_positions_scored < len(self.prompt_token_ids) - 1
        )

    @property
    def is_finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # the usual case, asked once per request per step
            return seqs[0].status is SequenceStatus.FINISHED
        return all(s.is_finished for s in seqs)

    def seed_for_choice(self, index: int) -> int:
        # Choice 0 uses the request's seed, so n=1 and the first of n>1 draw the same tokens.
        return self.seed if index == 0 else (self.seed + index * 0x9E3779B97F4A7C15) % (1 << 63)
