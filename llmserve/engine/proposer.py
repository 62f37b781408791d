"""What the scheduler asks of a speculative decoding proposer (`NgramProposer`, `DraftModelProposer`)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class DraftAsk:
    """Draft up to `limit` tokens to follow `token_ids`, the tokens of the sequence named `key`."""

    key: Hashable
    token_ids: list[int]
    limit: int


class Proposer(Protocol):
    num_speculative_tokens: int
    disable_by_batch_size: int | None

    def propose_batch(self, asks: list[DraftAsk]) -> list[list[int]]:
        """The drafts of each ask, in order (each within its limit; [] for none)."""
        ...

    def release(self, key: Hashable) -> None:
        """Forget the sequence named `key` (it ended or was preempted)."""
        ...
