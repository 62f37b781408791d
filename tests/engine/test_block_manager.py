from __future__ import annotations

import pytest

from llmserve.engine.block_manager import BlockManager
from llmserve.engine.sequence import Request, Sequence
from llmserve.sampling.params import SamplingParams


def _seq(num_tokens: int, rid: str = "r") -> Sequence:
    request = Request(rid, list(range(num_tokens)), SamplingParams(), seed=0, arrival_order=0)
    return Sequence(request, 0, list(range(num_tokens)), num_tokens, seed=0)


def test_grow_takes_blocks_as_tokens_arrive():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = _seq(5)
    bm.grow(seq, 5)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    bm.grow(seq, 8)  # still fits in two blocks
    assert len(seq.block_table) == 2
    bm.grow(seq, 9)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.check_invariants([seq])
    bm.release(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8
    bm.check_invariants([])


def test_cannot_grow_past_the_pool():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = _seq(9)
    assert not bm.can_grow(seq, 9)
    with pytest.raises(RuntimeError):
        bm.grow(seq, 9)
    assert bm.num_free_blocks == 2


def test_shared_blocks_are_ref_counted_and_freed_by_the_last_owner():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent, child = _seq(10), _seq(10, "c")
    bm.grow(parent, 10)
    bm.share(parent, child, 2)
    assert child.block_table == parent.block_table[:2]
    assert [bm.ref_counts[b] for b in parent.block_table] == [2, 2, 1]
    bm.check_invariants([parent, child])
    bm.release(parent)
    assert bm.num_free_blocks == 6  # the two shared blocks are still held by the child
    bm.check_invariants([child])
    bm.release(child)
    assert bm.num_free_blocks == 8
    bm.check_invariants([])


def test_invariant_check_catches_a_leak_and_a_double_owner():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = _seq(4)
    bm.grow(seq, 4)
    with pytest.raises(AssertionError):
        bm.check_invariants([])  # the block is used but nobody live owns it: a leak
    seq.block_table.append(seq.block_table[0])
    with pytest.raises(AssertionError):
        bm.check_invariants([seq])
