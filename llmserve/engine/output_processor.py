"""The front end's side of every step: the engine core sends token ids; here they become text
(incremental detokenization), stop strings are matched (across token boundaries), logprobs are
assembled, and each request's `RequestOutput` is built (vLLM v1's output processor). An embedding
request's one output carries its vector: it becomes an `EmbeddingRequestOutput`.

A choice that a stop string ends is finished here, first: the engine core only learns of it from the
front end (`ProcessedOutputs.stopped`) and drops the sequence then.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llmserve.engine.messages import EngineCoreOutput, EngineCoreRequest, PromptLogprobsChunk
from llmserve.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from llmserve.sampling.params import RequestOutputKind, SamplingParams
from llmserve.tokenizer.detokenizer import IncrementalDetokenizer
from llmserve.tokenizer.tokenizer import Tokenizer

TokenText = Callable[[int], str]


def logprob_entry(
    token: int, logprob: float, rank: int, top_ids: Sequence[int], top_logprobs: Sequence[float], text: TokenText
) -> dict[int, Logprob]:
    """One position's logprobs in vLLM's shape: the token's own first, then the top ones (ranked 1..k)."""
    entry = {token: Logprob(logprob, rank, text(token))}
    for position, (top_id, top_logprob) in enumerate(zip(top_ids, top_logprobs, strict=True)):
        if top_id not in entry:
            entry[top_id] = Logprob(top_logprob, position + 1, text(top_id))
    return entry


class ChoiceState:
    """One choice's text and tokens so far."""

    def __init__(self, index: int, tokenizer: Tokenizer, params: SamplingParams, token_text: TokenText) -> None:
        self.index = index
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.token_text = token_text
        self.text = ""
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        # Per token whose text is out, the text's length once it was (a token whose text the detokenizer
        # still holds, such as part of a UTF-8 character, has none yet), when the params ask for them.
        self.text_ends: list[int] | None = [] if params.track_text_ends else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.accepted_prediction_tokens = 0  # with a predicted output: its drafts the model took, and did not
        self.rejected_prediction_tokens = 0

    @property
    def token_ids(self) -> list[int]:
        return self.detokenizer.token_ids

    def add(self, output: EngineCoreOutput) -> bool:
        """Take one new token; True when a stop string ended the choice with it (and with the flushed
        text of a choice the core finished, False: the core knows it ended)."""
        token = output.token_id
        if output.num_draft_tokens:
            self.accepted_prediction_tokens = output.num_accepted_drafts
            self.rejected_prediction_tokens = output.num_draft_tokens - output.num_accepted_drafts
        if token < 0:  # the core ended the choice without a token (its grammar failed to compile)
            self.finish_reason = output.finish_reason
            return False
        if self.logprobs is not None and output.logprob is not None:
            self.logprobs.append(logprob_entry(
                token, output.logprob, output.rank or 0, output.top_ids or (), output.top_logprobs or (),
                self.token_text,
            ))
            self.cumulative_logprob += output.logprob
        if output.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            # The stop token (EOS or a stop_token_ids entry) that ended the choice is not part of its
            # text, as in vLLM, even when special tokens are kept (a tool-call format written in them).
            if self._append_text(self.detokenizer.flush()):
                return True
            self.detokenizer.token_ids.append(token)
            self._mark_text_ends()  # the stop token adds no text
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
            return False
        if self._append_text(self.detokenizer.add((token,))):
            return True
        if output.finish_reason is not None and not self._append_text(self.detokenizer.flush()):
            self._mark_text_ends()  # tokens that never made text (a special token left out of it)
            self.finish_reason, self.stop_reason = output.finish_reason, output.stop_reason
        return False

    def _mark_text_ends(self) -> None:
        """The tokens whose text is not out yet: it is now, up to the text's current end."""
        if self.text_ends is not None:
            self.text_ends.extend([len(self.text)] * (len(self.token_ids) - len(self.text_ends)))

    def _append_text(self, piece: str) -> bool:
        """Add detokenized text; finish the choice if a stop string now appears in it."""
        if not piece:
            return False
        previous = len(self.text)
        self.text += piece
        self._mark_text_ends()
        stops = self.params.stop
        if not stops:
            return False
        longest = max(len(s) for s in stops)
        window_start = max(0, previous - longest + 1)
        hits = [(i, s) for s in stops if (i := self.text.find(s, window_start)) >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        self.text = self.text[: index + (len(stop) if self.params.include_stop_str_in_output else 0)]
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def snapshot(self) -> CompletionOutput:
        text = self.text
        if self.finish_reason is None and self.params.stop:
            # Hold back what could still turn out to be the start of a stop string.
            holdback = max(len(s) for s in self.params.stop) - 1
            text = text[: max(0, len(text) - holdback)]
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=list(self.token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            text_ends=list(self.text_ends) if self.text_ends is not None else None,
            accepted_prediction_tokens=self.accepted_prediction_tokens,
            rejected_prediction_tokens=self.rejected_prediction_tokens,
        )


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    choices: dict[int, ChoiceState] = field(default_factory=dict)
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    num_finished_choices: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # complete before the first output is made
    is_embedding: bool = False

    @property
    def finished(self) -> bool:
        return self.num_finished_choices == self.params.n

    def embedding_output(self, embedding: bytes, now: float) -> EmbeddingRequestOutput:
        self.metrics.finished_time = now
        vector = np.frombuffer(embedding, dtype=np.float32)
        return EmbeddingRequestOutput(self.request_id, self.prompt_token_ids, EmbeddingOutput(vector), self.metrics.snapshot())

    def output(self) -> RequestOutput:
        """A snapshot: nothing in it changes as the request goes on, so other tasks may keep it."""
        choices = self.choices
        ordered = choices.values() if len(choices) == 1 else (choices[i] for i in sorted(choices))
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[c.snapshot() for c in ordered],
            finished=self.finished,
            metrics=self.metrics.snapshot(),
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,  # no longer changes: shared, not copied
            kv_transfer_params=self.kv_transfer_params,
        )

    def add_prompt_logprobs(self, chunk: PromptLogprobsChunk, text: TokenText) -> None:
        assert self.prompt_logprobs is not None and len(self.prompt_logprobs) == chunk.start
        tokens = self.prompt_token_ids[chunk.start : chunk.start + len(chunk.logprobs)]
        self.prompt_logprobs.extend(
            logprob_entry(token, logprob, rank, top_ids, top_logprobs, text)
            for token, logprob, rank, top_ids, top_logprobs in zip(
                tokens, chunk.logprobs, chunk.ranks, chunk.top_ids, chunk.top_logprobs, strict=True
            )
        )


@dataclass
class ProcessedOutputs:
    # of the requests that finished, or asked for every step's output
    outputs: list[RequestOutput | EmbeddingRequestOutput]
    stopped: list[tuple[str, int]]  # (request id, choice) that stop strings ended: tell the engine core


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.token_text: TokenText = functools.lru_cache(maxsize=65536)(self._decode_one)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def add_request(self, request: EngineCoreRequest, prompt: str | Sequence[int], arrival_time: float) -> None:
        """Follow `request` (as the input processor made it from `prompt`)."""
        text = prompt if isinstance(prompt, str) else None
        state = RequestState(
            request.request_id, text, request.prompt_token_ids, request.params, RequestMetrics(arrival_time)
        )
        if request.params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # the first prompt token has nothing before it
        state.is_embedding = request.pooling is not None
        self.requests[request.request_id] = state

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def process(
        self, outputs: Iterable[EngineCoreOutput], prompt_logprobs: Iterable[PromptLogprobsChunk] = ()
    ) -> ProcessedOutputs:
        """One step's outputs; its prompt logprobs go first (they precede the request's first token)."""
        for chunk in prompt_logprobs:
            state = self.requests.get(chunk.request_id)
            if state is not None and state.prompt_logprobs is not None:
                state.add_prompt_logprobs(chunk, self.token_text)
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        stopped: list[tuple[str, int]] = []
        results: list[RequestOutput | EmbeddingRequestOutput] = []
        for output in outputs:
            state = self.requests.get(output.request_id)
            if state is None:
                continue  # aborted, or a stop string ended it while the token was on its way
            if output.embedding is not None:
                state.metrics.first_scheduled_time = output.scheduled_time
                del self.requests[state.request_id]
                results.append(state.embedding_output(output.embedding, now))
                continue
            choice = state.choices.get(output.index)
            if choice is None:
                choice = state.choices[output.index] = ChoiceState(output.index, self.tokenizer, state.params, self.token_text)
            if choice.finish_reason is not None:
                continue
            self._note_times(state, output, now)
            if choice.add(output):
                stopped.append((state.request_id, output.index))
            if choice.finish_reason is not None:
                state.num_finished_choices += 1
            touched[state.request_id] = state
        for state in touched.values():
            if state.finished:
                state.metrics.finished_time = now
                del self.requests[state.request_id]
            elif state.params.output_kind is RequestOutputKind.FINAL_ONLY:
                continue
            results.append(state.output())
        return ProcessedOutputs(results, stopped)

    def _note_times(self, state: RequestState, output: EngineCoreOutput, now: float) -> None:
        metrics = state.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        if output.scheduled_time is not None:
            metrics.first_scheduled_time = output.scheduled_time
            state.num_cached_tokens = output.num_cached_tokens or 0
        if output.finish_reason is not None:
            metrics.num_preemptions = max(metrics.num_preemptions, output.num_preemptions)
        if output.kv_transfer is not None:
            held = output.kv_transfer
            state.kv_transfer_params = {"transfer_id": held.transfer_id, "remote_host": held.remote_host,
                                        "remote_port": held.remote_port, "num_tokens": held.num_tokens}

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request here (its choices finish with "abort"); its final output, or None if it was
        not running. The caller tells the engine core."""
        state = self.requests.pop(request_id, None)
        if state is None or state.is_embedding:
            return None
        for index in range(state.params.n):
            choice = state.choices.get(index)
            if choice is None:
                choice = state.choices[index] = ChoiceState(index, self.tokenizer, state.params, self.token_text)
            if choice.finish_reason is None:
                choice.finish_reason = "abort"
        state.num_finished_choices = state.params.n
        state.metrics.finished_time = time.monotonic()
        return state.output()
