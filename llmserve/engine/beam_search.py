"""Beam search (vLLM's `use_beam_search`), run by the front end over one-token requests, as vLLM v1 runs it.

Each step asks the engine for one token of every live beam (its prompt is the request's prompt and the beam's
tokens so far, so the prefix cache holds all but its last block) with the top 2 x width logprobs. Every beam
offers its 2 x width likeliest next tokens; a candidate ending in an end token (EOS unless `ignore_eos`, or a
`stop_token_ids` entry) is finished, and the `width` best of the others live on. A beam's score is its
cumulative logprob over (prompt + output tokens, an end token not counted) ** `length_penalty`, vLLM's. The
search stops after `max_tokens` steps, when no beam lives on, or when `width` beams have finished and the best
live beam scores below the width-th best finished one (transformers' default stopping heuristic); the `width`
best of the finished and live beams are the request's choices, best first.

`BeamSearch` holds one request's search; `BeamSearchStream` drives it from an `AsyncLLM` (the server) and
`LLM.generate` drives it on its own engine. Neither holds KV between steps: the prefix cache does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from llmserve.engine.messages import EngineCoreOutput
from llmserve.engine.output_processor import ChoiceState, TokenText
from llmserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmserve.sampling.params import RequestOutputKind, SamplingParams
from llmserve.tokenizer.tokenizer import Tokenizer


@dataclass(frozen=True)
class BeamToken:
    """One token of a beam and what the model scored at its position."""

    token: int
    logprob: float
    rank: int
    top_ids: tuple[int, ...]  # the top logprobs the request asked for (none without `logprobs`)
    top_logprobs: tuple[float, ...]


@dataclass(frozen=True)
class Beam:
    tokens: tuple[BeamToken, ...] = ()
    cumulative_logprob: float = 0.0
    ended: bool = False  # by an end token (not counted in the score's length)

    @property
    def token_ids(self) -> list[int]:
        return [t.token for t in self.tokens]


class BeamSearch:
    """One request's search. `params` is the request's (validated: `SamplingParams.validate` refuses what
    beam search does not take), its `max_tokens` resolved against the context window."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: Sequence[int]) -> None:
        assert params.use_beam_search and params.max_tokens is not None
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.width = params.n
        self.enders = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.live: list[Beam] = [Beam()]
        self.finished: list[Beam] = []
        self.steps = 0
        self.metrics = RequestMetrics(time.monotonic())
        self.num_cached_tokens = 0

    @property
    def step_params(self) -> SamplingParams:
        """One greedy token with the logprobs every beam's candidates and the request's logprobs need."""
        return SamplingParams(
            n=1, temperature=0.0, max_tokens=1, ignore_eos=True,
            logprobs=max(2 * self.width, self.params.logprobs or 0), output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def pending(self) -> list[list[int]]:
        """The prompts of this step's one-token requests (none once the search is over)."""
        if self.done:
            return []
        return [self.prompt_token_ids + beam.token_ids for beam in self.live]

    @property
    def done(self) -> bool:
        if not self.live or self.steps >= self.params.max_tokens:
            return True
        if len(self.finished) < self.width:
            return False
        worst_kept = sorted(map(self.score, self.finished), reverse=True)[self.width - 1]
        return max(map(self.score, self.live)) < worst_kept

    def score(self, beam: Beam) -> float:
        length = len(self.prompt_token_ids) + len(beam.tokens) - (1 if beam.ended else 0)
        return beam.cumulative_logprob / (length ** self.params.length_penalty)

    def advance(self, results: Sequence[RequestOutput]) -> None:
        """Take this step's outputs (one per live beam, in `pending`'s order)."""
        assert len(results) == len(self.live)
        if self.steps == 0 and results:
            first = results[0]
            self.metrics.first_scheduled_time = first.metrics.first_scheduled_time
            self.num_cached_tokens = first.num_cached_tokens
        self.steps += 1
        candidates: list[Beam] = []
        for beam, result in zip(self.live, results, strict=True):
            for token in self._candidates(result):
                grown = Beam(beam.tokens + (token,), beam.cumulative_logprob + token.logprob,
                             ended=token.token in self.enders)
                (self.finished if grown.ended else candidates).append(grown)
        candidates.sort(key=self.score, reverse=True)
        self.live = candidates[: self.width]

    def _candidates(self, result: RequestOutput) -> list[BeamToken]:
        """The 2 x width likeliest next tokens of one beam, each with the top logprobs the request asked for."""
        logprobs = result.outputs[0].logprobs
        assert logprobs, "a beam step asks for logprobs"
        ranked = sorted(logprobs[0].items(), key=lambda item: item[1].rank or 0)
        shown = ranked[: self.params.logprobs or 0]
        top_ids = tuple(token for token, _ in shown)
        top_logprobs = tuple(entry.logprob for _, entry in shown)
        return [BeamToken(token, entry.logprob, entry.rank or 0, top_ids, top_logprobs)
                for token, entry in ranked[: 2 * self.width]]

    def output(self, tokenizer: Tokenizer, token_text: TokenText) -> RequestOutput:
        """The request's finished output: its `width` best beams as choices, best first."""
        best = sorted(self.finished + self.live, key=self.score, reverse=True)[: self.width]
        now = time.monotonic()
        self.metrics.first_token_time = self.metrics.last_token_time = self.metrics.finished_time = now
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[self._choice(index, beam, tokenizer, token_text) for index, beam in enumerate(best)],
            finished=True,
            metrics=self.metrics.snapshot(),
            num_cached_tokens=self.num_cached_tokens,
        )

    def _choice(self, index: int, beam: Beam, tokenizer: Tokenizer, token_text: TokenText) -> CompletionOutput:
        """The beam's text, token ids and logprobs, as the output processor makes a sampled choice's."""
        choice = ChoiceState(index, tokenizer, self.params, token_text)
        last = len(beam.tokens) - 1
        for position, token in enumerate(beam.tokens):
            finish = None if position < last else ("stop" if beam.ended else "length")
            choice.add(EngineCoreOutput(
                self.request_id, token.token, index, finish_reason=finish,
                stop_reason=token.token if finish == "stop" and token.token in self.params.stop_token_ids else None,
                logprob=token.logprob, rank=token.rank, top_ids=list(token.top_ids),
                top_logprobs=list(token.top_logprobs),
            ))
        return dataclasses.replace(choice.snapshot(), cumulative_logprob=beam.cumulative_logprob)


class StepStream(Protocol):
    """A one-token step request's outputs (`AsyncLLM`'s `RequestStream`)."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def abort(self) -> None: ...


# Starts one step request (its id, prompt and params) and returns its stream.
StartStep = Callable[[str, list[int], SamplingParams], Awaitable[StepStream]]


class BeamSearchStream:
    """A beam-search request's outputs as `AsyncLLM.add_request` returns a request's (its one output, finished,
    comes at the end of the search). Aborting it, or dropping it, stops the search and its step requests."""

    def __init__(self, search: BeamSearch, start_step: StartStep, tokenizer: Tokenizer, token_text: TokenText) -> None:
        self.request_id = search.request_id
        self._done = False
        self.task = asyncio.ensure_future(_run(search, start_step, tokenizer, token_text))
        weakref.finalize(self, self.task.cancel)

    @property
    def finished(self) -> bool:
        return self._done

    def __aiter__(self) -> BeamSearchStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            # shielded: a reader that is cancelled leaves the search to `abort` (or the stream's drop)
            output = await asyncio.shield(self.task)
        except asyncio.CancelledError:
            raise
        except BaseException:
            self._done = True
            raise
        self._done = True
        return output

    def abort(self) -> None:
        """Stop the search unless it already finished; safe to call more than once."""
        self._done = True
        self.task.cancel()


async def _run(search: BeamSearch, start_step: StartStep, tokenizer: Tokenizer, token_text: TokenText) -> RequestOutput:
    step_params = search.step_params
    while prompts := search.pending():
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await start_step(f"{search.request_id}-beam{search.steps}-{i}", prompt, step_params))
            search.advance([await _final(stream) for stream in streams])
        finally:
            for stream in streams:
                stream.abort()
    return search.output(tokenizer, token_text)


async def _final(stream: StepStream) -> RequestOutput:
    last = None
    async for output in stream:
        last = output
    assert last is not None and last.finished
    return last
