"""The scheduler on its own: token budgets, chunked prefill, preemption order, priorities."""

from __future__ import annotations

import itertools

from llmserve.engine.block_manager import BlockManager
from llmserve.engine.scheduler import Scheduler
from llmserve.engine.sequence import Request, Sequence, SequenceStatus
from llmserve.outputs import RequestMetrics
from llmserve.sampling.params import SamplingParams

_order = itertools.count()


def _seq(num_tokens: int, priority: int = 0) -> Sequence:
    n = next(_order)
    request = Request(f"r{n}", None, list(range(num_tokens)), SamplingParams(), 0, n, RequestMetrics(0.0), priority)
    seq = Sequence(request, 0, list(range(num_tokens)), num_tokens, seed=0)
    request.seqs.append(seq)
    return seq


def _run_step(scheduler: Scheduler, new_token: int = 7) -> dict[Sequence, int]:
    """Pretend the model ran: advance computed counts and append a token where the chunk reached the end."""
    out = scheduler.schedule()
    for seq, n in out.scheduled.items():
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(new_token)
    return out


def test_long_prompt_is_chunked_while_running_sequences_decode():
    sched = Scheduler(BlockManager(64, 4), max_num_batched_tokens=16, max_num_seqs=8)
    short = _seq(4)
    sched.add(short)
    _run_step(sched)  # short prefilled in one step
    long = _seq(40)
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < 40:
        out = _run_step(sched)
        assert out.scheduled[short] == 1  # the decode keeps going every step
        chunks.append(out.scheduled[long])
        assert out.num_batched_tokens <= 16
    assert chunks == [15, 15, 10]


def test_budget_and_max_num_seqs_cap_admission():
    sched = Scheduler(BlockManager(64, 4), max_num_batched_tokens=10, max_num_seqs=2)
    seqs = [_seq(4) for _ in range(4)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert list(out.scheduled.values()) == [4, 4]
    assert sched.num_running == 2 and sched.num_waiting == 2


def test_preempts_the_latest_admitted_and_resumes_it_from_scratch():
    bm = BlockManager(4, 4)  # 16 tokens in all
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8)
    first, second = _seq(7), _seq(7)
    sched.add(first)
    sched.add(second)
    _run_step(sched)  # both prefilled: 2 blocks each, pool full, each now has 8 tokens
    assert bm.num_free_blocks == 0
    _run_step(sched)  # first computes token 8: fits in its 2 blocks; second the same
    out = _run_step(sched)  # first needs a third block: second (admitted last) is preempted
    assert out.preempted == [second]
    assert second.status is SequenceStatus.WAITING and second.num_computed_tokens == 0
    assert second.block_table == [] and second.request.metrics.num_preemptions == 1
    bm.check_invariants(sched.running)
    sched.remove(first)
    out = sched.schedule()
    assert out.scheduled == {second: second.num_tokens}  # recomputes prompt and outputs together
    bm.check_invariants(sched.running)


def test_fcfs_head_of_queue_is_not_overtaken():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8)
    big, small = _seq(20), _seq(2)
    sched.add(big)
    sched.add(small)
    out = sched.schedule()
    assert out.scheduled == {}  # big doesn't fit; small must wait behind it


def test_priority_policy_admits_urgent_request_first_and_preempts_the_lowest():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8, policy="priority")
    low_a, low_b = _seq(7, priority=5), _seq(7, priority=5)
    sched.add(low_a)
    sched.add(low_b)
    _run_step(sched)
    assert bm.num_free_blocks == 0
    waiting_low = _seq(4, priority=5)
    urgent = _seq(4, priority=0)
    sched.add(waiting_low)
    sched.add(urgent)
    assert sched.waiting[0] is urgent
    out = sched.schedule()
    assert urgent in out.scheduled and waiting_low not in out.scheduled
    assert out.preempted == [low_b]  # lowest priority, latest arrival
    bm.check_invariants(sched.running)
