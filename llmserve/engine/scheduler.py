"""Iteration-level scheduling: each step hands out a number of new tokens to each sequence.

There are no separate prefill and decode phases (vLLM v1's design). A running sequence with one
uncomputed token decodes; one with many (a prompt, or a prompt plus outputs after preemption) gets a
chunk of them. Running sequences are served first, oldest first, so decodes are never starved by a
long prompt; what is left of the step's token budget admits waiting sequences. When the KV pool runs
dry, the running sequence that is last in scheduling order is preempted: its blocks are freed and it
recomputes later from its tokens (which the sampler's counter-based randomness reproduces exactly).

With prefix caching, a sequence being admitted first takes the cached blocks of its longest cached
prefix and only computes the rest (a preempted sequence usually finds its own blocks still cached),
and while the queue is short the waiting sequence with the longest cached prefix goes first among
those ranking like the head of the queue, unless the head was overtaken too often already.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Callable
from dataclasses import dataclass, field

from llmserve.engine.block_manager import BlockManager
from llmserve.engine.sequence import Sequence, SequenceStatus

POLICIES = ("fcfs", "priority")
LPM_MAX_QUEUE = 128  # past this many waiting, admission is in plain queue order
MAX_OVERTAKES = 32  # a waiting sequence lets at most this many cache hits go first


@dataclass
class SchedulerOutput:
    scheduled: dict[Sequence, int] = field(default_factory=dict)  # sequence -> new tokens this step
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.scheduled.values())

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int, policy: str = "fcfs"
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"Unknown scheduling policy {policy!r}; use one of {', '.join(POLICIES)}.")
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.policy = policy
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.lpm_max_queue = LPM_MAX_QUEUE
        self.max_overtakes = MAX_OVERTAKES
        self.order: Callable[[Sequence], tuple] = (
            Sequence.sort_key if policy == "priority" else lambda s: s.sort_key()[1:]
        )

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        insort(self.waiting, seq, key=self.order)

    def add_running(self, seq: Sequence) -> None:
        """A forked sequence joins the batch directly, right away."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the queues and free its blocks (finish or abort)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.release(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.policy == "priority":
            self.running.sort(key=self.order)
        block_size = self.block_manager.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            total = seq.num_computed_tokens + num_new
            # Most decodes still have room in their last block: skip the block manager for them.
            if total > len(seq.block_table) * block_size:
                if not self._make_room(seq, total, out):
                    break  # seq itself was preempted: everything after it already was too
                self.block_manager.grow(seq, total)
            out.scheduled[seq] = num_new
            budget -= num_new
            i += 1
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt from the back of the running list until `seq` can hold `num_tokens`."""
        while not self.block_manager.can_grow(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            index = self._pick_waiting()
            seq = self.waiting[index]
            reused = self.block_manager.take_cached_prefix(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            total = seq.num_computed_tokens + num_new
            if not self.block_manager.can_grow(seq, total) and not self._evict_for(seq, total, out):
                if reused:  # not admitted after all: give the cached blocks back
                    self.block_manager.release(seq)
                    seq.num_computed_tokens = 0
                break  # nobody overtakes the sequence picked
            for skipped in self.waiting[:index]:
                skipped.times_overtaken += 1
            self.waiting.pop(index)
            self.block_manager.grow(seq, total)
            self._note_reuse(seq, reused)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled[seq] = num_new
            out.admitted.append(seq)
            if out.preempted:  # evictions gave their scheduled tokens back
                budget = self.max_num_batched_tokens - out.num_batched_tokens
            else:
                budget -= num_new

    def _pick_waiting(self) -> int:
        """Longest cached prefix first (SGLang's LPM), among the waiting sequences that rank like
        the head of the queue; plain queue order when the queue is long (the lookups would cost
        too much) or once the head was overtaken `max_overtakes` times (no starvation)."""
        head = self.waiting[0]
        if (
            not self.block_manager.enable_prefix_caching
            or not 1 < len(self.waiting) <= self.lpm_max_queue
            or head.times_overtaken >= self.max_overtakes
        ):
            return 0
        rank = self._rank(head)
        best, best_blocks = 0, self.block_manager.num_cached_prefix_blocks(head)
        for i in range(1, len(self.waiting)):
            seq = self.waiting[i]
            if self._rank(seq) != rank:
                break  # the queue is sorted: nothing after ranks like the head
            blocks = self.block_manager.num_cached_prefix_blocks(seq)
            if blocks > best_blocks:
                best, best_blocks = i, blocks
        return best

    def _rank(self, seq: Sequence) -> int:
        return seq.request.priority if self.policy == "priority" else 0

    def _note_reuse(self, seq: Sequence, reused: int) -> None:
        seq.num_cached_tokens = reused
        if self.block_manager.enable_prefix_caching:
            self.block_manager.count_lookup(seq.num_tokens, reused)
        request = seq.request
        if seq.index == 0 and request.num_cached_tokens is None:
            request.num_cached_tokens = reused

    def _evict_for(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Priority policy: a waiting sequence may preempt running ones that rank below it."""
        if self.policy != "priority":
            return False
        while not self.block_manager.can_grow(seq, num_tokens):
            victim = max(self.running, key=self.order, default=None)
            if victim is None or self.order(victim) <= self.order(seq):
                return False
            out.scheduled.pop(victim, None)
            if victim in out.admitted:
                out.admitted.remove(victim)
            self._preempt(victim, out)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.release(seq)
        seq.num_computed_tokens = 0
        seq.request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)
