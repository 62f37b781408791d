"""The paged KV cache's bookkeeping: a fixed pool of blocks, per-sequence block tables, ref counts.

The tensors live in the model runner; this class only decides which block ids hold which tokens.
A block may be shared (forked sequences share their prompt's full blocks), so blocks are
reference-counted and return to the free list when the last owner lets go.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from llmserve.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("The KV cache needs at least one block.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must take so its table covers `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_new_blocks(seq, num_tokens) <= len(self.free_blocks)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Extend `seq`'s block table to cover `num_tokens` tokens. The caller checked `can_grow`."""
        needed = self.num_new_blocks(seq, num_tokens)
        if needed > len(self.free_blocks):
            raise RuntimeError(f"KV cache out of blocks: need {needed}, have {len(self.free_blocks)}")
        for _ in range(needed):
            block = self.free_blocks.popleft()
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its blocks (finish, abort, preemption)."""
        for block in seq.block_table:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []

    def share(self, parent: Sequence, child: Sequence, num_blocks: int) -> None:
        """Give `child` the first `num_blocks` blocks of `parent` (full blocks only, never written again)."""
        shared = parent.block_table[:num_blocks]
        for block in shared:
            self.ref_counts[block] += 1
        child.block_table = list(shared)

    def check_invariants(self, live_seqs: Iterable[Sequence]) -> None:
        """Raise AssertionError unless the pool's accounting is exact for the given live sequences."""
        owners: Counter[int] = Counter()
        for seq in live_seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq} owns a block twice"
            owners.update(seq.block_table)
        free = set(self.free_blocks)
        assert len(free) == len(self.free_blocks), "a block is on the free list twice"
        assert len(free) + len(owners) == self.num_blocks, (
            f"free ({len(free)}) + used ({len(owners)}) != total ({self.num_blocks})"
        )
        assert not free & owners.keys(), "a free block is still owned"
        for block in range(self.num_blocks):
            assert self.ref_counts[block] == owners.get(block, 0), (
                f"block {block}: ref count {self.ref_counts[block]} but {owners.get(block, 0)} owners"
            )
