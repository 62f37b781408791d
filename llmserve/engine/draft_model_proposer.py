"""Draft tokens from a smaller model of the same vocabulary (vLLM's `draft_model` method): it decodes
greedily a few tokens ahead of the served model, which verifies them in its next step (the scheduler's
module says how). A draft that holds gives several tokens for the price of one step of the served model
plus a few of the small one, which is what speculation buys when the small model guesses well: a 1B model
drafting for an 8B one of its family, say.

The draft model has its own runner and KV pool, with as many blocks as the served model's, and keeps in it
each drafting sequence's tokens as far as it computed them: a step's drafts start by catching up on the
tokens the sequence gained since its last drafts (its prompt, the first time), the drafts the served
model rejected are dropped from the draft's cache as they are from the served model's, and a sequence
that ends or is preempted gives its blocks back. Nothing is shared by prefix: the draft recomputes a
prompt the served model found cached, at the draft's price. A sequence the draft's pool or context has
no room for gets no drafts that step. Under tensor parallelism the draft model is whole, on rank 0 (vLLM's
`draft_tensor_parallel_size` 1), built and run as if that rank were alone (`parallel.alone`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import numpy as np

from llmserve.config import SpeculativeConfig
from llmserve.engine.proposer import DraftAsk
from llmserve.model import parallel
from llmserve.model.runner import ModelRunner, StepBatch
from llmserve.sampling.params import SamplingParams
from llmserve.sampling.sampler import SamplingRow

_GREEDY = SamplingRow(SamplingParams(temperature=0.0), seed=0, sample_index=0, prompt_token_ids=(),
                      output_token_ids=())


@dataclass
class _DraftState:
    """A sequence's share of the draft model's KV pool. The blocks hold the KV of its first `num_tokens` tokens
    (a sequence's tokens are only ever appended to), then of the drafts in `fed`."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    fed: list[int] = field(default_factory=list)

    def keep_valid(self, tokens: list[int]) -> None:
        """Drop what no longer holds the sequence's tokens: the drafts past the first it did not take, and never
        its last token (the draft's next step computes it to sample from)."""
        held = self.num_tokens
        for draft in self.fed:
            if held >= len(tokens) or tokens[held] != draft:
                break
            held += 1
        self.num_tokens, self.fed = min(held, len(tokens) - 1), []


@dataclass
class _Work:
    state: _DraftState
    tokens: list[int]  # the sequence's tokens: the draft continues them
    limit: int
    drafts: list[int] = field(default_factory=list)
    cursor: int = 0  # tokens the draft's cache holds so far while catching up

    @property
    def behind(self) -> int:
        return len(self.tokens) - self.cursor


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, runner: ModelRunner, max_model_len: int, step_tokens: int) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.disable_by_batch_size = config.disable_by_batch_size
        self.runner = runner
        self.block_size = runner.block_size
        self.max_model_len = max_model_len  # the draft model's positions: a longer sequence gets no drafts
        self.step_tokens = step_tokens  # tokens one catch-up step of the draft model computes at most
        self.vocab_size = runner.model_config.vocab_size
        self.free_blocks = list(range(runner.num_blocks - 1, -1, -1))
        self.states: dict[Hashable, _DraftState] = {}

    def check_invariants(self, live: Iterable[Hashable]) -> None:
        """Every block is free or held by one sequence, and only live sequences hold any."""
        held = [block for state in self.states.values() for block in state.blocks]
        if sorted(held + self.free_blocks) != list(range(self.runner.num_blocks)):
            raise AssertionError("the draft model's KV blocks are not each free or held once")
        stale = set(self.states) - set(live)
        if stale:
            raise AssertionError(f"the draft model holds the blocks of {len(stale)} sequences no longer live")

    def release(self, key: Hashable) -> None:
        state = self.states.pop(key, None)
        if state is not None:
            self.free_blocks.extend(reversed(state.blocks))

    def propose_batch(self, asks: list[DraftAsk]) -> list[list[int]]:
        work = [self._prepare(ask) for ask in asks]
        active = [item for item in work if item is not None and item.limit > 0]
        if active:
            self._catch_up(active)
            self._decode(active)
            for item in active:
                item.state.num_tokens, item.state.fed = len(item.tokens), item.drafts[:-1]
        return [item.drafts if item is not None else [] for item in work]

    # ---- each sequence's room ---------------------------------------------------------------------
    def _prepare(self, ask: DraftAsk) -> _Work | None:
        """The sequence's state with what its cache holds beyond its tokens dropped, and blocks for the
        drafts it may have (its limit cut to what the pool and the draft's context allow)."""
        state = self.states.setdefault(ask.key, _DraftState())
        tokens = ask.token_ids
        state.keep_valid(tokens)
        count = len(tokens)
        limit = min(ask.limit, self.max_model_len - count + 1)
        # KV for every token and every draft but the last
        capacity = (len(state.blocks) + len(self.free_blocks)) * self.block_size
        limit = min(limit, capacity - count + 1)
        if limit < 1:
            return None
        needed = -(-(count + limit - 1) // self.block_size) - len(state.blocks)
        for _ in range(needed):
            state.blocks.append(self.free_blocks.pop())
        return _Work(state, tokens, limit)

    # ---- the draft model's steps -----------------------------------------------------------------
    def _catch_up(self, work: list[_Work]) -> None:
        """Compute the tokens each sequence's cache lacks, in steps of at most `step_tokens` (shortest
        first: one-token rows lead a step as decodes), and sample each one's first draft after its last."""
        for item in work:
            item.cursor = item.state.num_tokens
        pending = sorted(work, key=lambda item: item.behind)
        while pending:
            budget, rows = self.step_tokens, []
            for item in pending:
                take = min(item.behind, budget)
                if take < 1:
                    break
                rows.append((item, take))
                budget -= take
            sampling = [i for i, (item, take) in enumerate(rows) if take == item.behind]
            sampled = self._run([item.tokens[item.cursor : item.cursor + take] for item, take in rows],
                                [item.cursor for item, _ in rows], [item.state.blocks for item, _ in rows], sampling)
            for i, token in zip(sampling, sampled, strict=True):
                rows[i][0].drafts.append(token)
            for item, take in rows:
                item.cursor += take
            pending = [item for item in pending if item.behind]

    def _decode(self, work: list[_Work]) -> None:
        """Feed each sequence its last draft until it has as many as its limit, all of them one batch."""
        while active := [item for item in work if len(item.drafts) < item.limit]:
            sampled = self._run(
                [[item.drafts[-1]] for item in active],
                [len(item.tokens) + len(item.drafts) - 1 for item in active],
                [item.state.blocks for item in active], list(range(len(active))),
            )
            for item, token in zip(active, sampled, strict=True):
                item.drafts.append(token)

    def _run(self, inputs: list[list[int]], begins: list[int], tables: list[list[int]], sampling: list[int]) -> list[int]:
        """One step of the draft model: each row's tokens from position `begin`; greedy samples of the rows
        in `sampling`."""
        ids = np.fromiter((t for row in inputs for t in row), dtype=np.int64)
        batch = StepBatch(
            # A served token past the draft's vocabulary (an image placeholder, a padding row's id) reads as token
            # 0: the draft only guesses, and the served model verifies every guess.
            input_ids=np.where(ids < self.vocab_size, ids, 0),
            num_computed=np.array(begins, dtype=np.int64),
            num_new=np.array([len(row) for row in inputs], dtype=np.int64),
            block_tables=tables,
            logits_rows=sampling,
            sampling_rows=[_GREEDY] * len(sampling),
        )
        with parallel.alone():  # beside a served model split over tensor-parallel ranks, the draft is whole
            output = self.runner.execute(batch).result()
        return output.token_ids if output is not None else []

