"""Per-request sampling parameters, validated up front (vLLM's `SamplingParams` shape)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from llmserve.errors import InvalidRequestError

_GREEDY_EPS = 1e-5
MAX_BEAM_WIDTH = 10  # each step asks for 2 x width logprobs, and 20 is the most a request may ask for


class RequestOutputKind(enum.Enum):
    """When the engine reports a request (vLLM's names): after every step that adds a token, with the
    whole output so far, or once, when it finishes (offline generation needs nothing sooner)."""

    CUMULATIVE = 0
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output (vLLM's `structured_outputs`): exactly one kind is set."""

    json: str | None = None  # a JSON schema, as JSON text (a dict is accepted and dumped)
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # an EBNF grammar (xgrammar's / GBNF syntax)
    # xgrammar's structural tag, as JSON text (a dict is accepted and dumped): free text with constrained
    # parts where triggers appear, e.g. tool calls whose arguments follow their schemas
    structural_tag: str | None = None
    # The constraint applies after this token sequence appears in the output (a reasoning model's
    # end-of-thinking token); empty: from the first output token.
    start_after: list[int] = field(default_factory=list)


@dataclass
class ThinkingBudgetParams:
    """A cap on a reasoning model's thinking (vLLM's `thinking_token_budget`): once `max_tokens` tokens have been
    generated inside the reasoning section and it has not ended, its end (`end`, e.g. the tokens of `</think>`) is
    forced, and the reply goes on after it."""

    max_tokens: int
    end: list[int]
    # The section opens once these appear in the output (`<think>`); empty: it is open from the first output token
    # (the prompt opened it).
    start: list[int] = field(default_factory=list)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16  # None: up to the context window
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token (0: only the chosen token)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    thinking_budget: ThinkingBudgetParams | None = None
    prompt_logprobs: int | None = None  # top logprobs per prompt token (0: only the prompt token's own)
    # Keep only the prompt's last k tokens (-1: as many as the context window holds); None: all of it.
    truncate_prompt_tokens: int | None = None
    # Added to the logits of these token ids before penalties and temperature (OpenAI's logit_bias: -100
    # bans a token in practice, 100 all but forces it); logprobs stay those of the model's own logits.
    logit_bias: dict[int, float] | None = None
    # vLLM's: only these token ids may be sampled (None: any)
    allowed_token_ids: list[int] | None = None
    # vLLM's: words the output never contains, as written and after a space. The input processor, which
    # has the tokenizer, fills in their token sequences; the last token of one is banned wherever the
    # output so far ends with the ones before it.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's beam search: the n best of n beams (n at most MAX_BEAM_WIDTH), scored by cumulative logprob over
    # length ** length_penalty (`llmserve.engine.beam_search`). It is greedy: no sampling or logit changes.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # OpenAI's Predicted Outputs: text the output is expected to repeat much of (a file being edited). Its tokens
    # (the input processor fills them in) are speculative drafts, verified as any are: the output is the same with
    # or without it, only sooner where they agree (`llmserve.engine.prediction`).
    prediction: str | None = None
    prediction_token_ids: list[int] | None = None
    # The front end records where each token's text ended (`CompletionOutput.text_ends`): a server that
    # shows only part of the text (a safety screen) shows only those tokens' ids and logprobs.
    track_text_ends: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids or []))  # each once: looked up every step
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = self.logit_bias or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def reads_history(self) -> bool:
        """Whether sampling the next token needs the tokens so far: penalties, or a bad word of several
        tokens (a single-token one is banned everywhere)."""
        return self.penalised or any(len(ids) > 1 for ids in self.bad_words_token_ids or ())

    def validate(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(message, param=param)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"n must be at least 1, got {self.n}.")
        if self.temperature < 0:
            raise bad("temperature", f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise bad("top_k", f"top_k must be -1 (disabled) or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", f"repetition_penalty must be positive, got {self.repetition_penalty}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", f"logprobs must be in [0, 20], got {self.logprobs}.")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad("prompt_logprobs", f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}.")
        if self.truncate_prompt_tokens is not None and not (
            self.truncate_prompt_tokens == -1 or self.truncate_prompt_tokens >= 1
        ):
            raise bad(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens must be -1 or at least 1, got {self.truncate_prompt_tokens}.",
            )
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "seed must be an integer.")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "stop_token_ids must be non-negative token ids.")
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise bad("logit_bias", f"logit_bias keys must be non-negative token ids, got {token!r}.")
            if not -100.0 <= bias <= 100.0:
                raise bad("logit_bias", f"logit_bias values must be in [-100, 100], got {bias} for token {token}.")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", "allowed_token_ids must name at least one token id.")
            if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "allowed_token_ids must be non-negative token ids.")
        if any(not isinstance(word, str) for word in self.bad_words or ()):
            raise bad("bad_words", "bad_words must be strings.")
        if self.prediction is not None and not isinstance(self.prediction, str):
            raise bad("prediction", "prediction must be a string.")
        if self.thinking_budget is not None:
            _validate_thinking_budget(self.thinking_budget)
        if self.use_beam_search:
            self._validate_beam_search()

    def _validate_beam_search(self) -> None:
        """What beam search does not take is refused naming it: it scores the model's own logprobs."""
        if self.n > MAX_BEAM_WIDTH:
            raise InvalidRequestError(f"n (the beam width) must be at most {MAX_BEAM_WIDTH} with use_beam_search, "
                                      f"got {self.n}.", param="n")
        if not math.isfinite(self.length_penalty):
            raise InvalidRequestError("length_penalty must be a finite number.", param="length_penalty")
        changed = {
            "temperature": not self.greedy, "top_p": self.top_p != 1.0, "top_k": self.top_k != 0,
            "min_p": self.min_p != 0.0, "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0, "repetition_penalty": self.repetition_penalty != 1.0,
            "min_tokens": self.min_tokens != 0, "stop": bool(self.stop), "logit_bias": self.logit_bias is not None,
            "allowed_token_ids": self.allowed_token_ids is not None, "bad_words": bool(self.bad_words),
            "structured_outputs": self.structured_outputs is not None,
            "thinking_budget": self.thinking_budget is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
        }
        for name, given in changed.items():
            if given:
                raise InvalidRequestError(
                    f"use_beam_search does not take {name}: beam search ranks the model's own logprobs (greedy, "
                    "unchanged by sampling settings, penalties or constraints) and ends beams at EOS, "
                    "stop_token_ids or max_tokens.", param=name)


def _validate_thinking_budget(budget: ThinkingBudgetParams) -> None:
    def token_ids(ids: object) -> bool:
        return isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)

    if not isinstance(budget.max_tokens, int) or isinstance(budget.max_tokens, bool) or budget.max_tokens < 0:
        raise InvalidRequestError(f"thinking_budget.max_tokens must be a non-negative integer, got "
                                  f"{budget.max_tokens!r}.", param="thinking_budget")
    if not budget.end or not token_ids(budget.end) or not token_ids(budget.start):
        raise InvalidRequestError("thinking_budget.end must be token ids (at least one), and start token ids.",
                                  param="thinking_budget")
