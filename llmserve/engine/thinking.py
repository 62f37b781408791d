"""A reasoning model's thinking, capped (`SamplingParams.thinking_budget`, vLLM's `thinking_token_budget`): one
sequence's reasoning section followed token by token; once it holds its budget of tokens and has not ended, its end
tokens are forced, one step each, and the reply goes on after them. The section is open from the first output token
when the prompt opened it; else it opens only if the output starts with its start tokens (as the reasoning parser
reads a reply).

It stands where a grammar stands (`Sequence.grammar`), so the scheduler treats it as one: it follows each appended
token, a sequence under it does not speculate while it is not done, nor run a step ahead of its pending token near
the budget's end (where that token decides whether the next one is forced), and each step's token bitmask holds its
forced token. A request with structured output as well keeps its grammar inside
(started after the reasoning's end, `start_after`): the grammar sees every token, forced ones included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from llmserve.engine.grammar import GrammarState
    from llmserve.sampling.params import ThinkingBudgetParams


class ThinkingBudget:
    """One sequence's reasoning section: before it opens, inside it (its tokens counted), then over."""

    def __init__(self, params: ThinkingBudgetParams, grammar: GrammarState | None = None) -> None:
        self._start = list(params.start)
        self._end = list(params.end)
        self._budget = params.max_tokens
        self._grammar = grammar
        self._tail: list[int] = []  # the last output tokens, matched against the start or the end
        self.opened = not self._start
        self.closed = False
        self.spent = 0  # tokens generated inside the section
        self._forced: int | None = None  # while forcing the end: how many of its tokens are out
        if self.opened:
            self._force_when_spent()

    @property
    def constrains(self) -> bool:
        """Whether the next token is constrained (forced, or by the grammar)."""
        return self._forced is not None or (self._grammar is not None and self._grammar.constrains)

    @property
    def done(self) -> bool:
        return self.closed and (self._grammar is None or self._grammar.done)

    def waits_for(self, pending: int) -> bool:
        """Whether the next token's constraint may depend on the `pending` output tokens not known yet: only near
        the budget's end (one of them may close the section, or spend the budget) or while forcing."""
        if pending == 0:
            return False
        if self._grammar is not None and self._grammar.waits_for(pending):
            return True
        if self.closed:
            return False
        return not self.opened or self._forced is not None or self.spent + pending >= self._budget

    def accept(self, token: int) -> None:
        """Follow one appended output token."""
        if self._grammar is not None:
            self._grammar.accept(token)
        if self.closed:
            return
        if not self.opened:  # reasoning is what the output starts with, as the reasoning parser reads it
            self._tail.append(token)
            if self._tail != self._start[: len(self._tail)]:
                self.closed = True  # it did not start with it: there is no reasoning section
            elif len(self._tail) == len(self._start):
                self.opened, self._tail = True, []
                self._force_when_spent()
            return
        if self._forced is not None:  # the token is the forced one: the mask allowed nothing else
            self._forced += 1
            if self._forced == len(self._end):
                self._forced, self.closed = None, True
            return
        self.spent += 1
        self._tail = (self._tail + [token])[-len(self._end):]
        if self._tail == self._end:
            self.closed = True
            return
        self._force_when_spent()

    def _force_when_spent(self) -> None:
        """Start forcing the end once the budget is spent, from as much of it as the output already ends with."""
        if self.spent < self._budget:
            return
        self._forced = next((k for k in range(min(len(self._end) - 1, len(self._tail)), 0, -1)
                             if self._tail[-k:] == self._end[:k]), 0)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 bitmask ([rows, ceil(V / 32)])."""
        if self._forced is None:
            assert self._grammar is not None
            self._grammar.fill_bitmask(bitmask, row)
            return
        token = self._end[self._forced]
        words = bitmask[row].view(np.uint32)
        words[:] = 0
        words[token // 32] = np.uint32(1) << np.uint32(token % 32)
