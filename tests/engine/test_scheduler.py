"""The scheduler on its own: token budgets, chunked prefill, preemption order, priorities, overlapped scheduling
(step N+1 scheduled before step N's tokens are known), and a step's budget of image tokens."""

from __future__ import annotations

from llmserve.engine.block_manager import BlockManager
from llmserve.engine.prefix_cache import hash_root
from llmserve.engine.scheduler import Scheduler
from llmserve.engine.sequence import Request, Sequence, SequenceStatus
from llmserve.multimodal.inputs import ImageInput
from llmserve.sampling.params import SamplingParams
from tests.engine.steps import add, sampled, scheduled, step

EOS = 1


def test_long_prompt_is_chunked_while_running_sequences_decode():
    sched = Scheduler(BlockManager(64, 4), max_num_batched_tokens=16, max_num_seqs=8)
    short = add(sched, 4)
    step(sched)  # short prefilled in one step
    long = add(sched, 40)
    chunks = []
    while long.num_computed_tokens < 40:
        out = scheduled(step(sched))
        assert out[short] == 1  # the decode keeps going every step
        chunks.append(out[long])
        assert sum(out.values()) <= 16
    assert chunks == [15, 15, 10]
    assert long.num_output_tokens == 1 and short.num_output_tokens == 4


def test_budget_and_max_num_seqs_cap_admission():
    sched = Scheduler(BlockManager(64, 4), max_num_batched_tokens=10, max_num_seqs=2)
    for _ in range(4):
        add(sched, 4)
    out = sched.schedule()
    assert [row.num_new for row in out.rows] == [4, 4]
    assert sched.num_running == 2 and sched.num_waiting == 2


def test_waiting_sequences_are_counted_per_priority_for_admission_control():
    sched = Scheduler(BlockManager(64, 4), max_num_batched_tokens=8, max_num_seqs=1, policy="priority")
    add(sched, 4, priority=5)
    step(sched)  # runs; the rest wait behind it
    for tokens, priority in ((6, 5), (3, 0), (9, 5), (2, 7)):
        add(sched, tokens, priority=priority)
    assert sched.waiting_by_priority() == [(0, 1, 3), (5, 2, 15), (7, 1, 2)]
    first_come = Scheduler(BlockManager(64, 4), max_num_batched_tokens=8, max_num_seqs=1)
    add(first_come, 4, priority=5)
    assert first_come.waiting_by_priority() == []  # every waiting request is ahead of a new one


def test_preempts_the_latest_admitted_and_resumes_it_from_scratch():
    bm = BlockManager(4, 4)  # 16 tokens in all
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8)
    first, second = add(sched, 7), add(sched, 7)
    step(sched)  # both prefilled: 2 blocks each, pool full, each now has 8 tokens
    assert bm.num_free_blocks == 0
    step(sched)  # first computes token 8: fits in its 2 blocks; second the same
    out = step(sched)  # first needs a third block: second (admitted last) is preempted
    assert out.preempted == [second]
    assert second.status is SequenceStatus.WAITING and second.num_computed_tokens == 0
    assert second.block_table == [] and second.request.num_preemptions == 1
    bm.check_invariants(sched.running)
    sched.finish_requests([first.request.request_id])
    out = sched.schedule()
    assert scheduled(out) == {second: second.num_tokens}  # recomputes prompt and outputs together
    bm.check_invariants(sched.running)


def test_fcfs_head_of_queue_is_not_overtaken():
    sched = Scheduler(BlockManager(4, 4), max_num_batched_tokens=64, max_num_seqs=8)
    add(sched, 20)
    add(sched, 2)
    assert not sched.schedule()  # the first doesn't fit; the small one must wait behind it


def test_priority_policy_admits_urgent_request_first_and_preempts_the_lowest():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8, policy="priority")
    add(sched, 7, priority=5)
    low_b = add(sched, 7, priority=5)
    step(sched)
    assert bm.num_free_blocks == 0
    waiting_low = add(sched, 4, priority=5)
    urgent = add(sched, 4, priority=0)
    assert sched.waiting[0] is urgent
    out = sched.schedule()
    assert urgent in scheduled(out) and waiting_low not in scheduled(out)
    assert out.preempted == [low_b]  # lowest priority, latest arrival
    bm.check_invariants(sched.running)


# ---- overlapped scheduling -------------------------------------------------------------------------


def test_the_next_step_decodes_the_pending_token_and_learns_it_one_step_later():
    sched = Scheduler(BlockManager(16, 4), max_num_batched_tokens=64, max_num_seqs=8)
    seq = add(sched, 5)
    first = sched.schedule()  # the prompt: samples one token
    assert first.rows[0].pending_source == -1 and seq.num_pending == 1
    second = sched.schedule()  # scheduled before the first step's token is known
    assert scheduled(second) == {seq: 1}
    assert second.rows[0].begin == 5 and second.rows[0].pending_source == 0  # sample row 0 of the first step
    assert seq.num_tokens == 5 and seq.num_pending == 2 and seq.num_computed_tokens == 6
    sched.update_from_output(first, sampled(first, token=40))
    assert seq.token_ids[5:] == [40] and seq.num_pending == 1
    sched.update_from_output(second, sampled(second, token=41))
    assert seq.token_ids[5:] == [40, 41] and seq.num_pending == 0


def test_a_stop_learned_late_drops_the_extra_token_and_frees_every_block():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8, eos_token_ids=[EOS])
    seq = add(sched, 5, params=SamplingParams(max_tokens=50))
    other = add(sched, 6, params=SamplingParams(max_tokens=50))
    first = sched.schedule()
    second = sched.schedule()
    outputs = sched.update_from_output(first, sampled(first, token=EOS))  # both stop on their first token
    assert [(o.token_id, o.finish_reason) for o in outputs] == [(EOS, "stop"), (EOS, "stop")]
    assert seq.is_finished and other.is_finished and not sched.has_unfinished()
    assert bm.num_free_blocks == 16
    assert sched.update_from_output(second, sampled(second, token=9)) == []  # computed, and dropped
    assert seq.token_ids[5:] == [EOS]
    bm.check_invariants([])


def test_no_step_is_scheduled_past_max_tokens():
    sched = Scheduler(BlockManager(16, 4), max_num_batched_tokens=64, max_num_seqs=8)
    seq = add(sched, 5, params=SamplingParams(max_tokens=2))
    first = sched.schedule()
    second = sched.schedule()  # the second token
    assert not sched.schedule()  # two tokens are on their way: nothing more to compute
    sched.update_from_output(first, sampled(first))
    outputs = sched.update_from_output(second, sampled(second))
    assert outputs[0].finish_reason == "length" and seq.num_output_tokens == 2 and seq.is_finished


def test_penalised_requests_wait_for_their_pending_token():
    sched = Scheduler(BlockManager(16, 4), max_num_batched_tokens=64, max_num_seqs=8)
    plain = add(sched, 5)
    penalised = add(sched, 5, params=SamplingParams(max_tokens=None, repetition_penalty=1.2))
    first = sched.schedule()
    assert set(scheduled(sched.schedule())) == {plain}  # the penalty reads the history: it waits
    sched.update_from_output(first, sampled(first))
    assert penalised in scheduled(sched.schedule())


def test_a_sequence_preempted_with_a_token_in_flight_recomputes_once_it_is_known():
    bm = BlockManager(4, 4)  # 16 tokens
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8)
    first, second = add(sched, 7), add(sched, 7)
    step_a = sched.schedule()  # both prompts: two blocks each, the pool is full
    step_b = sched.schedule()  # both decode their pending token (the 8th slot of their blocks)
    sched.update_from_output(step_a, sampled(step_a))
    step_c = sched.schedule()  # first needs a third block: second goes, with step B's token in flight
    assert step_c.preempted == [second] and second.num_pending == 1
    sched.finish_requests([first.request.request_id])
    assert not sched.schedule()  # blocks are free, but second's tokens are not all known yet
    sched.update_from_output(step_b, sampled(step_b, token=9))
    sched.update_from_output(step_c, sampled(step_c))
    assert second.token_ids[7:] == [7, 9] and second.num_pending == 0
    assert scheduled(sched.schedule()) == {second: 9}  # prompt and both outputs, recomputed
    bm.check_invariants(sched.running)


def _with_image(sched: Scheduler, name: str, tokens: int, offset: int, length: int, max_tokens: int = 1) -> Sequence:
    """Queue a request of `tokens` ids whose placeholders `offset`..`offset + length` stand for the image `name`."""
    image = ImageInput(offset, length, name.encode(), b"", (0,), (1, 1), length)
    request = Request(name, list(range(tokens)), SamplingParams(max_tokens=max_tokens), seed=0,
                      arrival_order=len(sched.requests), cache_root=hash_root("m"), images=[image])
    sched.add_request(request)
    return request.seqs[0]


def test_an_image_a_cached_prefix_cuts_is_computed_by_the_first_chunk_and_counted_against_the_steps_images():
    """The prefix cache gives the second request the first 12 of its 16 tokens, cutting its image (6..14) in two:
    its chunk computes the image's features (8 tokens), which leaves too little of the step's 16 for the third
    request's image at its very start: the third waits a step, though tokens were left for it."""
    sched = Scheduler(BlockManager(32, 4, enable_prefix_caching=True), max_num_batched_tokens=16, max_num_seqs=8)
    _with_image(sched, "a", 16, 6, 8)
    step(sched)  # prefilled, sampled its one token, ended: its blocks are cached
    again = _with_image(sched, "a", 16, 6, 8)
    other = _with_image(sched, "b", 12, 0, 10)
    assert scheduled(step(sched)) == {again: 4}
    assert again.request.num_cached_tokens == 12 and other.status is SequenceStatus.WAITING
    assert scheduled(step(sched)) == {other: 12}
