"""Draft tokens for speculative decoding by n-gram lookup in the sequence itself (vLLM's `ngram` method,
"prompt lookup decoding"): text that repeats what came before (code being edited, a quoted passage, a
list, a model caught in a loop) is proposed from where it appeared, at the cost of a search, no model.

The longest suffix of `max_n` down to `min_n` tokens that occurred earlier is looked up; the tokens that
followed its latest earlier occurrence with as many tokens after it as are wanted (else its latest) are the
draft: in text repeating with a short period, the occurrence just before has too few. The scheduler has
them verified in the next step.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from llmserve.config import SpeculativeConfig
from llmserve.engine.proposer import DraftAsk


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.disable_by_batch_size = config.disable_by_batch_size

    def propose_batch(self, asks: list[DraftAsk]) -> list[list[int]]:
        return [self.propose(ask.token_ids, ask.limit) for ask in asks]

    def release(self, key: Hashable) -> None:
        pass  # nothing is kept per sequence

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to `limit` (and `num_speculative_tokens`) tokens that may follow `token_ids`; [] when its
        suffix occurred nowhere earlier."""
        limit = min(limit, self.num_speculative_tokens)
        count = len(token_ids)
        if limit < 1 or count <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, count - 1), self.min_n - 1, -1):
            starts = _earlier_occurrences(tokens, n)
            if len(starts):
                whole = starts[starts <= count - n - limit]  # followed by `limit` tokens
                start = int(whole[-1] if len(whole) else starts[-1])
                return tokens[start + n : start + n + limit].tolist()
        return []


def _earlier_occurrences(tokens: np.ndarray, n: int) -> np.ndarray:
    """The starts, in order, of the occurrences of the last `n` tokens that end before the last token."""
    suffix = tokens[-n:]
    starts = np.flatnonzero(tokens[: len(tokens) - n] == suffix[0])
    for offset in range(1, n):
        if not len(starts):
            break
        starts = starts[tokens[starts + offset] == suffix[offset]]
    return starts
