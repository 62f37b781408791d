"""Prefix caching: block accounting with shared, cached and evicted blocks (no model), then the
engine on the tiny model: reuse across requests, copy-on-write for n > 1, cache_salt, exactness."""

from __future__ import annotations

import itertools

import pytest

from llmserve import LLM, SamplingParams
from llmserve.engine import prefix_cache
from llmserve.engine.block_manager import BlockManager
from llmserve.engine.prefix_cache import hash_root
from llmserve.engine.scheduler import Scheduler
from llmserve.engine.sequence import Request, Sequence, SequenceStatus
from llmserve.sampling.params import SamplingParams as Params
from tests.engine.steps import add, scheduled, step

BS = 4
_order = itertools.count()


def _seq(tokens: list[int], salt: str | None = None) -> Sequence:
    n = next(_order)
    request = Request(f"r{n}", list(tokens), Params(), seed=0, arrival_order=n, cache_root=hash_root("m", salt))
    seq = Sequence(request, 0, list(tokens), len(tokens), seed=0)
    request.seqs.append(seq)
    return seq


def _compute(bm: BlockManager, seq: Sequence) -> None:
    """The block manager's state once every token of `seq` has KV (these tests are of the block
    manager alone; the scheduler's own transitions are tested below and in test_scheduler)."""
    bm.grow(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed(seq)


def _admit(bm: BlockManager, seq: Sequence) -> int:
    reused = bm.take_cached_prefix(seq)
    seq.num_computed_tokens = reused
    _compute(bm, seq)
    return reused


PROMPT = list(range(100, 110))  # 10 tokens: two full blocks and a partial one


# ---- block accounting ----------------------------------------------------------------------------


def test_same_prefix_shares_full_blocks_and_frees_them_to_the_cache():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    first, second = _seq(PROMPT), _seq(PROMPT + [1, 2])
    assert _admit(bm, first) == 0
    assert _admit(bm, second) == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]  # the partial block is never shared
    assert [bm.ref_counts[b] for b in first.block_table] == [2, 2, 1]
    bm.check_invariants([first, second])
    bm.release(first)
    assert [bm.ref_counts[b] for b in second.block_table] == [1, 1, 1]
    bm.check_invariants([second])
    bm.release(second)
    bm.check_invariants([])
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 3  # second's third block was full too
    third = _seq(PROMPT + [1, 2, 3])
    assert bm.take_cached_prefix(third) == 12  # still cached after every owner left
    bm.release(third)
    bm.check_invariants([])


def test_the_last_token_is_always_computed():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    _admit(bm, _seq(PROMPT[:8]))
    again = _seq(PROMPT[:8])  # both blocks are cached, but the logits need the last token computed
    assert bm.take_cached_prefix(again) == 4


def test_cached_blocks_are_evicted_least_recently_used_first_and_only_when_needed():
    bm = BlockManager(6, BS, enable_prefix_caching=True)
    a, b, c = (_seq([t] * 5) for t in (1, 2, 3))  # one full block each, plus a partial one
    for seq in (a, b, c):
        _admit(bm, seq)
    for seq in (a, b, c):
        bm.release(seq)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 3
    filler = _seq(list(range(200, 212)))  # three fresh blocks: the unnamed partial blocks go first
    bm.grow(filler, 12)
    assert bm.num_cached_blocks == 3
    touched = _seq([2] * 5)
    assert bm.take_cached_prefix(touched) == 4  # b is now the most recently used
    bm.release(touched)
    bm.grow(filler, 16)  # one more block: evicts a, the least recently used
    assert bm.num_cached_blocks == 2
    assert [bm.num_cached_prefix_blocks(_seq([t] * 5)) for t in (1, 2, 3)] == [0, 1, 1]
    bm.grow(filler, 20)  # then c
    assert [bm.num_cached_prefix_blocks(_seq([t] * 5)) for t in (1, 2, 3)] == [0, 1, 0]
    bm.check_invariants([filler])
    bm.release(filler)
    bm.check_invariants([])
    assert bm.num_free_blocks == 6


def test_a_partly_filled_last_block_is_handed_whole_to_the_one_sequence_that_continues_it():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    first = _seq(PROMPT)  # two full blocks, then 2 computed tokens in a third
    _admit(bm, first)
    tail_block = first.block_table[2]
    bm.release(first)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2
    follow_up = _seq(PROMPT + [1, 2, 3])
    assert bm.take_cached_prefix(follow_up) == 10  # both full blocks, then the tail's 2 tokens
    assert follow_up.block_table[2] == tail_block and bm.ref_counts[tail_block] == 1
    other = _seq(PROMPT + [1, 2, 3])
    assert bm.take_cached_prefix(other) == 8  # the tail went to the first taker; full blocks are shared
    _compute(bm, follow_up)
    _compute(bm, other)
    bm.check_invariants([follow_up, other])
    assert follow_up.block_table[2] != other.block_table[2]
    for seq in (follow_up, other):
        bm.release(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == 8


def test_a_tail_serves_a_prompt_that_diverges_inside_it_and_never_the_last_token():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    first = _seq(PROMPT + [1])  # 3 computed tokens in the third block: 108, 109, 1
    _admit(bm, first)
    bm.release(first)
    same = _seq(PROMPT + [1])  # the whole tail matches, but its own last token must be computed
    same.num_computed_tokens = bm.take_cached_prefix(same)  # as the scheduler admits it
    assert same.num_computed_tokens == 10
    bm.release(same)  # taken back without computing: filed again with the 2 tokens it holds for sure
    diverging = _seq(PROMPT + [2, 3])  # shares 108, 109, then differs
    assert bm.take_cached_prefix(diverging) == 10
    _compute(bm, diverging)  # writes its own tokens into the rest of the block
    bm.check_invariants([diverging])
    bm.release(diverging)
    bm.check_invariants([])
    assert bm.num_free_blocks == 8


def test_tails_are_evicted_before_named_full_blocks():
    bm = BlockManager(4, BS, enable_prefix_caching=True)
    a, b = _seq([1] * 6), _seq([2] * 6)  # one full block and a tail each
    _admit(bm, a)
    _admit(bm, b)
    for seq in (a, b):
        bm.release(seq)
    filler = _seq(list(range(300, 308)))
    bm.grow(filler, 8)  # two blocks: both tails go, the named blocks stay
    assert bm.num_cached_blocks == 2
    again = _seq([1] * 6)
    assert bm.take_cached_prefix(again) == 4  # the full block only: its tail was evicted
    bm.check_invariants([filler, again])
    for seq in (filler, again):
        bm.release(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == 4


def test_a_hash_collision_is_a_miss_not_a_wrong_hit(monkeypatch):
    monkeypatch.setattr(prefix_cache, "hash_block", lambda parent, tokens, images=b"": b"same-for-everything")
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    first, other = _seq(PROMPT), _seq([7] * 10)
    _admit(bm, first)
    assert _admit(bm, other) == 0  # same hash, other tokens: recomputed
    assert bm.num_cached_blocks == 1  # the name was taken: the second block stays unnamed
    bm.check_invariants([first, other])
    same = _seq(PROMPT)
    assert bm.take_cached_prefix(same) == 4  # block 1's parent hash matches, but it is unnamed
    for seq in (first, other, same):
        bm.release(seq)
    bm.check_invariants([])


def test_cache_salt_keeps_a_prefix_private():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    _admit(bm, _seq(PROMPT, salt="alice"))
    assert bm.take_cached_prefix(_seq(PROMPT, salt="bob")) == 0
    assert bm.take_cached_prefix(_seq(PROMPT)) == 0
    assert bm.take_cached_prefix(_seq(PROMPT, salt="alice")) == 8


def test_caching_off_keeps_nothing():
    bm = BlockManager(8, BS)
    seq = _seq(PROMPT)
    _admit(bm, seq)
    bm.release(seq)
    assert bm.take_cached_prefix(_seq(PROMPT)) == 0 and bm.num_cached_blocks == 0
    bm.check_invariants([])


def test_invariant_check_catches_a_cached_block_on_the_plain_free_list():
    bm = BlockManager(8, BS, enable_prefix_caching=True)
    seq = _seq(PROMPT)
    _admit(bm, seq)
    bm.release(seq)
    block = next(iter(bm._evictable))
    del bm._evictable[block]
    bm._free.append(block)
    with pytest.raises(AssertionError):
        bm.check_invariants([])


# ---- with the scheduler: abort and preemption of sharers ---------------------------------------


def test_abort_of_one_of_two_sharers_leaves_the_other_whole():
    bm = BlockManager(16, BS, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8)
    first = add(sched, PROMPT)
    step(sched)
    second = add(sched, PROMPT + [5])
    out = step(sched)
    assert scheduled(out)[second] == 3 and second.num_cached_tokens == 8
    assert second.request.num_cached_tokens == 8
    shared = second.block_table[:2]
    assert [bm.ref_counts[b] for b in shared] == [2, 2]
    sched.finish_requests([first.request.request_id])  # abort
    assert [bm.ref_counts[b] for b in shared] == [1, 1]
    bm.check_invariants(sched.running)
    for _ in range(6):
        step(sched)
    bm.check_invariants(sched.running)
    sched.finish_requests([second.request.request_id])
    bm.check_invariants([])
    assert bm.num_free_blocks == 16


def test_a_preempted_sharer_comes_back_through_the_cache():
    bm = BlockManager(6, BS, enable_prefix_caching=True)  # 24 tokens
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8)
    first = add(sched, PROMPT)
    step(sched)
    second = add(sched, PROMPT)
    step(sched)  # second reuses first's two full blocks
    assert bm.ref_counts[first.block_table[0]] == 2
    preempted = []
    for _ in range(12):
        out = step(sched)
        preempted += out.preempted
        bm.check_invariants(sched.running)
        if preempted and second.status is SequenceStatus.RUNNING:
            break
    assert preempted == [second]
    assert second.num_cached_tokens >= 8  # its shared prefix (at least) was still cached
    assert bm.ref_counts[first.block_table[0]] == 2
    sched.finish_requests([first.request.request_id, second.request.request_id])
    bm.check_invariants([])
    assert bm.num_free_blocks == 6


def test_waiting_queue_prefers_cached_prefixes_unless_the_head_starves():
    bm = BlockManager(64, BS, enable_prefix_caching=True)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=1)
    warm = add(sched, PROMPT)
    step(sched)
    sched.finish_requests([warm.request.request_id])
    cold, hot = add(sched, list(range(300, 310))), add(sched, PROMPT + [1])
    out = step(sched)
    assert list(scheduled(out)) == [hot] and cold.times_overtaken == 1
    sched.finish_requests([hot.request.request_id])
    sched.max_overtakes = 1
    add(sched, PROMPT + [2])
    out = sched.schedule()
    assert list(scheduled(out)) == [cold]  # overtaken once already: its turn now


# ---- the engine on the tiny model ---------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    kwargs = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64, max_model_len=512)
    return LLM(str(tiny_llama_dir), **kwargs), LLM(str(tiny_llama_dir), enable_prefix_caching=False, **kwargs)


def _assert_pool_empty(llm: LLM) -> None:
    llm.engine.check_invariants()
    bm = llm.engine.core.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished_requests()


def test_second_turn_reuses_the_first_turns_kv_and_outputs_do_not_change(engines):
    cached, plain = engines
    system = list(range(20, 60))  # a 40-token shared "system prompt"
    turn1 = system + [5, 6, 7]
    first = cached.generate([turn1], GREEDY)[0]
    assert first.num_cached_tokens == 0
    history = turn1 + first.outputs[0].token_ids
    turn2 = history + [8, 9, 10, 11]
    second = cached.generate([turn2], GREEDY)[0]
    # Everything turn 1 computed (its prompt and all but its last sampled token): three full blocks
    # and the four tokens of its partly filled last block, handed over whole.
    assert second.num_cached_tokens == len(history) - 1 == 48 + 4
    assert second.outputs[0].token_ids == plain.generate([turn2], GREEDY)[0].outputs[0].token_ids
    assert plain.generate([turn2], GREEDY)[0].num_cached_tokens == 0
    others = [system + [t] * 9 for t in range(3, 9)]
    together = cached.generate(others, GREEDY)
    assert [o.num_cached_tokens for o in together] == [32] * 6
    assert [o.outputs[0].token_ids for o in together] == [
        o.outputs[0].token_ids for o in plain.generate(others, GREEDY)
    ]
    stats = cached.engine.stats()
    assert stats.prefix_cache_hits == 52 + 6 * 32
    assert stats.prefix_cache_queries == len(turn1) + len(turn2) + sum(len(p) for p in others)
    _assert_pool_empty(cached)
    _assert_pool_empty(plain)


def test_requests_with_the_same_prefix_share_blocks_while_they_run(engines):
    cached, _ = engines
    engine = cached.engine
    prefix = list(range(300, 340))
    engine.add_request("a", prefix + [1], GREEDY)
    engine.step()
    engine.add_request("b", prefix + [2, 3], GREEDY)
    engine.step()
    a, b = engine.core.scheduler.requests["a"].seqs[0], engine.core.scheduler.requests["b"].seqs[0]
    assert a.block_table[:2] == b.block_table[:2]
    assert [engine.core.block_manager.ref_counts[x] for x in a.block_table[:2]] == [2, 2]
    engine.check_invariants()
    engine.abort_request("a")
    engine.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    _assert_pool_empty(cached)


def test_n_greater_than_one_copies_the_partial_block_instead_of_recomputing(engines):
    cached, plain = engines
    engine = cached.engine
    prompt = list(range(10, 50))  # two full blocks and 8 tokens in a third
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    engine.add_request("n4", prompt, params)
    while not engine.step():  # the prompt's step and its samples: the fork (a step later when overlapped)
        pass
    seqs = engine.core.scheduler.requests["n4"].seqs
    assert [s.num_computed_tokens for s in seqs[1:]] == [40] * 3  # no recompute: a copy
    partial = {s.block_table[2] for s in seqs}
    assert len(partial) == 4  # each choice writes its own third block
    assert [engine.core.block_manager.ref_counts[b] for b in seqs[0].block_table[:2]] == [4, 4]
    assert len(engine.core.scheduler.pending_copies) == 3
    engine.check_invariants()
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        engine.check_invariants()
    expected = plain.generate([prompt], params)[0]
    assert [c.token_ids for c in outputs["n4"].outputs] == [c.token_ids for c in expected.outputs]
    _assert_pool_empty(cached)


def test_cache_salt_isolates_requests(engines):
    cached, _ = engines
    engine = cached.engine
    prompt = list(range(400, 440))
    salted = [("s1", "tenant-a"), ("s2", "tenant-b"), ("s3", "tenant-a"), ("s4", None)]
    reused = {}
    for request_id, salt in salted:
        engine.add_request(request_id, prompt, GREEDY, cache_salt=salt)
        while engine.has_unfinished_requests():
            for out in engine.step():
                reused[out.request_id] = out.num_cached_tokens
    assert reused == {"s1": 0, "s2": 0, "s3": 32, "s4": 0}
    _assert_pool_empty(cached)


def test_preemption_recomputes_through_the_cache_and_outputs_do_not_change(tiny_llama_dir):
    kwargs = dict(dtype="float32", num_kv_blocks=12, max_num_batched_tokens=32, max_model_len=128)
    prompts = [list(range(50, 90)) + [t] * 5 for t in range(6)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    on = LLM(str(tiny_llama_dir), **kwargs)
    off = LLM(str(tiny_llama_dir), enable_prefix_caching=False, **kwargs)
    got = on.generate(prompts, params)
    assert on.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in off.generate(prompts, params)]
    _assert_pool_empty(on)
