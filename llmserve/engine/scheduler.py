"""Iteration-level scheduling, and every change to request and block state that follows a step.

Each step hands out a number of new tokens to each sequence. There are no separate prefill and
decode phases (vLLM v1's design). A running sequence with one uncomputed token decodes; one with many
(a prompt, or a prompt plus outputs after preemption) gets a chunk of them. Running sequences are
served first, oldest first, so decodes are never starved by a long prompt; what is left of the
step's token budget admits waiting sequences. When the KV pool runs dry, the running sequence that
is last in scheduling order is preempted: its blocks are freed and it recomputes later from its
tokens (which the sampler's counter-based randomness reproduces exactly).

With prefix caching, a sequence being admitted first takes the cached blocks of its longest cached
prefix and only computes the rest (a preempted sequence usually finds its own blocks still cached),
and while the queue is short the waiting sequence with the longest cached prefix goes first among
those ranking like the head of the queue, unless the head was overtaken too often already.

The scheduler is the only owner of sequence state (nano-vllm's rule, vLLM's `update_from_output`):
`schedule()` advances each scheduled sequence's computed count and counts the tokens the step will
sample as pending, and names the blocks it fills in the prefix cache; `update_from_output()`
appends the sampled tokens, finishes sequences that stopped, forks the choices of an n > 1 request
and names the blocks that a newly known token completed;
`finish_requests()` ends requests from outside (aborts, stop strings). A request whose prompt KV another
engine will read (disaggregation's `export_kv`) has its prompt blocks held by the core's hook as it ends
normally, before its sequence lets them go. A sequence with a grammar
(structured output) follows each appended token in its `GrammarState` there too; tokens recomputed
after a preemption are never appended again, so they never advance it twice.

Scheduling may run one step ahead of the results (overlapped scheduling): a sequence whose last
token is still pending decodes it in the next step straight from the device, so its next input token
is named, not known. What needs the pending token's value waits for it: a preempted sequence is not
re-admitted until its pending token arrived, and a request with penalties or a bad word of several
tokens (which read its history) or with a grammar (structured output: its token mask depends on every token so far),
or near the end of its thinking budget (the pending token decides whether the next is forced), skips a step rather
than sample from a stale one. A sequence that will have reached its
length limit once its pending tokens arrive is not scheduled again.

Speculative decoding (`--speculative-config`; steps then run one after another): a decoding sequence
gets the draft tokens its proposer (n-gram lookup, or a draft model: `Proposer`) finds, within the step's
budget and its limits, and only where the KV pool has room without preempting anyone; every decoding
sequence's room is set aside first, and the proposer drafts for all of them in one call. Each draft is a row of its own
after the sequence's row, a decode at its position reading the cache up to it (the step writes every
row's KV before any row attends), so a verifying step runs as a decode-only step does: the attention
backends' decode kernels, CUDA graphs by token count, the CPU's one-call decoder. Every position of
the row is sampled as a decode would sample it (its own counter of the request's randomness, the drafts
before it as its history), so the tokens accepted, the drafts up to the first one the model did not
sample plus the model's token there, are exactly the tokens decoding one at a time would give. The
computed count then goes back by the rejected drafts: their KV slots are written again later, and no
block holding them was named in the prefix cache (only known token ids name blocks). A sequence under
a grammar or a thinking budget does not speculate until it is done (its state would have to follow the drafts). Drafts that miss cost compute
(and, on CPU, a step of more than 16 tokens leaves the one-call decoder), so each sequence's draft length
follows its acceptance: the accepted count plus one after a miss, twice as long after a whole draft held
(up to `num_speculative_tokens`), and a sequence whose drafts keep failing outright pauses speculating for
1, 2, 4, ... up to 32 of its steps. Where a step's cost per token jumps past some size (`fast_step_tokens`:
the CPU's one-call decoder), a sequence whose last drafts failed outright only drafts within that size, but
for one probing step in 32 where they all may; where a larger step is compute-bound (a CPU without bf16
GEMM instructions), no draft takes a step past that size. A request with a predicted output (OpenAI's Predicted
Outputs, prediction.py) drafts from it, speculative decoding configured or not (up to 16 tokens, and within the
fast step's size), and the proposer drafts for the others.

A vision-language model's images have a budget of their own (vLLM's encoder budget): the image tokens whose
features a step computes, a step's tokens in all (what the memory profile's step computed). A chunk that reaches the
first placeholder of an image it cannot afford stops before it, and the sequence takes the rest in a later step;
a step's first image always fits (an image larger than a step is computed alone). An image a chunk reaches past its
first placeholder was computed by an earlier chunk, unless the chunk is the first after admission (the prefix cache
gave it the image's first tokens): then it counts too.

An embedding request (`Request.pooling`) is prefill-only work under the same token budget: its whole
prompt is admitted in one step or waits (it is never chunked: an encoder attends both ways, and mean
pooling needs every token's hidden state), packed with the step's other rows, bypassing the prefix
cache; it is not a running sequence (never preempted, never scheduled again) and ends when its
step's embedding is applied, its KV blocks (a decoder's; an encoder's engine has none) freed then.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from llmserve.engine.block_manager import BlockManager
from llmserve.engine.messages import EngineCoreOutput, PromptLogprobsChunk, SpecDecodeStats
from llmserve.engine.prediction import MAX_MATCH_TOKENS, PREDICTION_DRAFT_TOKENS, draft_from_prediction
from llmserve.engine.proposer import DraftAsk, Proposer
from llmserve.engine.sequence import Request, Sequence, SequenceStatus
from llmserve.model.runner import ModelOutput

POLICIES = ("fcfs", "priority")
MAX_DRAFT_PAUSE = 32  # steps a sequence whose drafts keep missing goes without drafting, at most
LPM_MAX_QUEUE = 128  # past this many waiting, admission is in plain queue order
MAX_OVERTAKES = 32  # a waiting sequence lets at most this many cache hits go first


@dataclass(slots=True)
class ScheduledRow:
    seq: Sequence
    begin: int  # the sequence's computed tokens before this step: its first new position
    num_new: int
    pending_source: int = -1  # when its last new token is still pending: the previous step's sample row
    draft: int = -1  # a speculative token's row (one token, a decode at its position): the token


@dataclass(slots=True)
class SampleTarget:
    row: int  # the row whose last new token gives the logits
    seq: Sequence
    choice: int  # the choice the token is for: seq.index, or a choice still to fork from seq
    drafts: tuple[int, ...] = ()  # speculative tokens to verify: one more sample for each, in the rows after `row`


@dataclass(slots=True)
class PromptScoreTarget:
    row: int
    request: Request
    begin: int  # the first prompt position scored (it scores the prompt token after it)
    count: int


@dataclass(slots=True)
class PoolTarget:
    row: int  # a row holding a whole embedding request's prompt
    seq: Sequence


@dataclass
class SchedulerOutput:
    rows: list[ScheduledRow] = field(default_factory=list)  # decodes (one new token) first
    samples: list[SampleTarget] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    prompt_scores: list[PromptScoreTarget] = field(default_factory=list)
    pools: list[PoolTarget] = field(default_factory=list)  # embedding requests, in row order

    @property
    def num_batched_tokens(self) -> int:
        return sum(row.num_new for row in self.rows)

    def __bool__(self) -> bool:
        return bool(self.rows)


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int, policy: str = "fcfs",
        eos_token_ids: Iterable[int] = (), max_model_len: int | None = None, pooling_needs_kv: bool = True,
        max_loras: int | None = None, proposer: Proposer | None = None, fast_step_tokens: int | None = None,
        strict_fast_step: bool = False, export_kv: Callable[[Sequence], None] | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"Unknown scheduling policy {policy!r}; use one of {', '.join(POLICIES)}.")
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.policy = policy
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.pooling_needs_kv = pooling_needs_kv  # False for an encoder: embeddings take no blocks
        self.max_loras = max_loras  # LoRA adapters the running sequences may use between them; None: no LoRA
        self.requests: dict[str, Request] = {}
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.lpm_max_queue = LPM_MAX_QUEUE
        self.max_overtakes = MAX_OVERTAKES
        self.order: Callable[[Sequence], tuple] = (
            Sequence.sort_key if policy == "priority" else lambda s: s.sort_key()[1:]
        )
        self.pending_copies: list[tuple[Sequence, int, int]] = []  # (child, src, dst) copy-on-write
        self.proposer = proposer  # speculative decoding: the draft tokens of decoding sequences
        self.fast_step_tokens = fast_step_tokens  # the most tokens a step takes before its cost per token jumps
        self.strict_fast_step = strict_fast_step  # past it every token costs in full: drafts never go there
        self.draft_rounds = 0  # steps that could take drafts (speculating, nothing preempted)
        self.spec = SpecDecodeStats()
        self.num_predicting = 0  # unfinished requests with a predicted output: they draft from it
        # A prediction's drafts keep a lone sequence's step within the fast step (its token and the drafts).
        self.prediction_draft_tokens = (PREDICTION_DRAFT_TOKENS if fast_step_tokens is None
                                        else max(1, min(PREDICTION_DRAFT_TOKENS, fast_step_tokens - 1)))
        self.export_kv = export_kv  # disaggregation: holds an ending `export_kv` request's prompt blocks

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- requests in and out ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        seq = Sequence(request, 0, list(request.prompt_token_ids), len(request.prompt_token_ids), request.seed)
        request.seqs.append(seq)
        self.requests[request.request_id] = request
        if request.prediction is not None:
            self.num_predicting += 1
        self._enqueue(seq)

    def finish_requests(self, request_ids: Iterable[str], reason: str = "abort") -> list[Request]:
        """End requests wherever they are; their blocks return to the pool at once. Unknown ids
        (finished already) are skipped."""
        finished = []
        for request_id in request_ids:
            request = self._forget(request_id)
            if request is None:
                continue
            for seq in request.seqs:
                if not seq.is_finished:
                    seq.finish_reason = reason
                    self._remove(seq)
            finished.append(request)
        return finished

    def finish_choices(self, choices: Iterable[tuple[str, int]], reason: str = "stop") -> None:
        """End single choices (request id, choice index), e.g. the ones a stop string ended."""
        for request_id, index in choices:
            request = self.requests.get(request_id)
            if request is None:
                continue
            for seq in request.seqs:
                if seq.index == index and not seq.is_finished:
                    seq.finish_reason = reason
                    self._remove(seq)
            if request.is_finished:
                self._forget(request_id)

    def _forget(self, request_id: str) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is not None and request.prediction is not None:
            self.num_predicting -= 1
        return request

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        insort(self.waiting, seq, key=self.order)

    def _remove(self, seq: Sequence) -> None:
        """Take `seq` out of the queues and free its blocks (those of its prompt held first, when it ended
        normally and another engine is to read them)."""
        if seq.status is SequenceStatus.RUNNING:
            if seq.request.pooling is None:  # an embedding request in its step is not in `running`
                self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if seq.request.export_kv and seq.finish_reason in ("stop", "length") and self.export_kv is not None:
            self.export_kv(seq)
        self.block_manager.release(seq)
        if self.proposer is not None:
            self.proposer.release(seq)
        seq.status = SequenceStatus.FINISHED

    # ---- scheduling -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        scheduled: dict[Sequence, int] = {}
        drafts: dict[Sequence, tuple[int, ...]] = {}
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        images_left = self.max_num_batched_tokens  # the image tokens whose features the step may compute
        if self.policy == "priority":
            self.running.sort(key=self.order)
        block_size = self.block_manager.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            i += 1
            if not self._schedulable(seq):
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            if seq.num_computed_tokens < seq.request.images_end:
                num_new, computed = self._images_within(seq, num_new, images_left, fresh=False)
                if not num_new:
                    continue
                images_left -= computed
            total = seq.num_computed_tokens + num_new
            # Most decodes still have room in their last block: skip the block manager for them.
            if total > len(seq.block_table) * block_size:
                if not self._make_room(seq, total, out):
                    break  # seq itself was preempted: everything after it already was too
                self.block_manager.grow(seq, total)
            scheduled[seq] = num_new
            budget -= num_new
        if not out.preempted:
            speculating = self.proposer is not None and self._speculating()
            if speculating or self.num_predicting:
                budget = self._add_drafts(scheduled, drafts, budget, speculating)
            self._admit(scheduled, out, budget, images_left)
        self._after_schedule(scheduled, drafts, out)
        return out

    def _images_within(self, seq: Sequence, num_new: int, images_left: int, fresh: bool) -> tuple[int, int]:
        """How many of `num_new` tokens `seq`'s chunk takes so that the images whose features it computes fit
        `images_left` (the step's first image always does), and those images' tokens. `fresh`: the chunk is the
        first since admission, so an image it starts inside is computed too."""
        begin, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
        computed = 0
        for image in seq.request.images:
            if image.offset >= end:
                break
            if image.offset + image.length <= begin or (image.offset < begin and not fresh):
                continue  # behind the chunk, or computed by an earlier chunk
            first_of_step = images_left == self.max_num_batched_tokens and not computed
            if computed + image.length > images_left and not first_of_step:
                return max(0, image.offset - begin), computed
            computed += image.length
        return num_new, computed

    def _speculating(self) -> bool:
        """Drafts are proposed unless the batch is as large as `disable_by_batch_size` (vLLM's option: a large
        batch's step costs more per token, which drafts that miss waste)."""
        assert self.proposer is not None
        limit = self.proposer.disable_by_batch_size
        return limit is None or len(self.running) < limit

    def _add_drafts(
        self, scheduled: dict[Sequence, int], drafts: dict[Sequence, tuple[int, ...]], budget: int, speculating: bool
    ) -> int:
        """Speculative tokens for the decoding sequences (those with a predicted output, and the others when
        `speculating`), once every running one has its token (they come before admissions, as in vLLM); returns
        the budget left. Each sequence's room (budget, step size, free blocks) is set aside before the proposer
        drafts for all of them at once (a draft model decodes them as one batch), and what a draft leaves unused
        goes back."""
        rows = sum(scheduled.values())
        self.draft_rounds += 1
        probing = self.draft_rounds % MAX_DRAFT_PAUSE == 0
        free_blocks = self.block_manager.num_free_blocks
        asks: list[tuple[Sequence, int]] = []
        for seq, num_new in scheduled.items():
            if budget < 1:
                break
            if num_new == 1 and (speculating or seq.request.prediction is not None):
                limit, blocks = self._draft_limit(seq, self._draft_room(seq, budget, rows, probing), free_blocks)
                if limit:
                    asks.append((seq, limit))
                    budget, rows, free_blocks = budget - limit, rows + limit, free_blocks - blocks
        if not asks:
            return budget
        for (seq, limit), proposed in zip(asks, self._propose(asks), strict=True):
            proposed = tuple(proposed[:limit])
            budget += limit - len(proposed)
            if proposed:
                self.block_manager.grow(seq, seq.num_computed_tokens + 1 + len(proposed))
                drafts[seq] = proposed
                scheduled[seq] = 1 + len(proposed)
        return budget

    def _propose(self, asks: list[tuple[Sequence, int]]) -> list[list[int]]:
        """Each ask's draft: from its request's prediction if it has one, else from the proposer (in one call)."""
        proposals: list[list[int]] = [[] for _ in asks]
        others: list[int] = []
        for i, (seq, limit) in enumerate(asks):
            prediction = seq.request.prediction
            if prediction is None:
                others.append(i)
                continue
            recent = seq.token_ids[max(seq.num_prompt_tokens, seq.num_tokens - MAX_MATCH_TOKENS):]
            proposals[i], seq.prediction_cursor = draft_from_prediction(prediction, recent, seq.prediction_cursor,
                                                                        limit)
        if others:
            assert self.proposer is not None
            proposed = self.proposer.propose_batch([DraftAsk(asks[i][0], asks[i][0].token_ids, asks[i][1])
                                                    for i in others])
            for i, draft in zip(others, proposed, strict=True):
                proposals[i] = draft
        return proposals

    def _draft_room(self, seq: Sequence, budget: int, rows: int, probing: bool) -> int:
        """The most drafts `seq` may add to a step of `rows` tokens. Past `fast_step_tokens` a step costs more
        per token, so drafts that likely miss would slow every sequence: one whose last drafts missed outright
        keeps the step within it, except in a probing step, one in MAX_DRAFT_PAUSE, where such sequences all
        try together (text turning repetitive is found again at the cost of one slower step). Where the step
        is compute-bound past it (`strict_fast_step`), no draft goes there: even drafts that all hold cost
        more than they give."""
        edge = self.fast_step_tokens
        if edge is None:
            return budget
        may_pass = not self.strict_fast_step and (rows > edge or probing or seq.draft_limit != 1)
        return budget if may_pass else min(budget, max(0, edge - rows))

    def _draft_limit(self, seq: Sequence, budget: int, free_blocks: int) -> tuple[int, int]:
        """How many drafts a decoding sequence may have, within the budget, its length limits and the free
        blocks (speculation never preempts), and the blocks that many would take; (0, 0) when none."""
        if (seq.grammar is not None and not seq.grammar.done) or seq.num_pending or seq.num_uncomputed_tokens != 1 \
                or not seq.num_output_tokens:
            return 0, 0  # (before its first token an n > 1 request's choices are not forked yet)
        if seq.draft_pause:
            seq.draft_pause -= 1
            return 0, 0
        params = seq.request.params
        limit = min(budget, seq.draft_limit) if seq.draft_limit else budget
        if params.max_tokens is not None:
            limit = min(limit, params.max_tokens - seq.num_output_tokens - 1)
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len - seq.num_tokens - 1)
        if seq.request.prediction is not None:
            limit = min(limit, self.prediction_draft_tokens)
        else:
            assert self.proposer is not None
            limit = min(limit, self.proposer.num_speculative_tokens)
        bm = self.block_manager
        limit = min(limit, (len(seq.block_table) + free_blocks) * bm.block_size - seq.num_computed_tokens - 1)
        if limit < 1:
            return 0, 0
        return limit, bm.num_new_blocks(seq, seq.num_computed_tokens + 1 + limit)

    def _schedulable(self, seq: Sequence) -> bool:
        """Whether a running sequence can compute a token now (see the module's last paragraph)."""
        if not seq.num_pending:
            return True
        params = seq.request.params
        if params.reads_history:
            return False
        if seq.grammar is not None and seq.grammar.waits_for(seq.num_pending):
            return False
        outputs = seq.num_output_tokens + seq.num_pending
        if params.max_tokens is not None and outputs >= params.max_tokens:
            return False
        return self.max_model_len is None or seq.num_tokens_with_pending < self.max_model_len

    def _after_schedule(
        self, scheduled: dict[Sequence, int], drafts: dict[Sequence, tuple[int, ...]], out: SchedulerOutput
    ) -> None:
        """Rows in batch order (decodes first, scheduling order kept), computed counts advanced, and
        one sample for each row whose new tokens reach its end (n of them for an unforked n > 1)."""
        items = sorted(scheduled.items(), key=lambda item: item[1] != 1 and item[0] not in drafts)
        rows, samples = out.rows, out.samples
        naming = self.block_manager.enable_prefix_caching
        for seq, num_new in items:
            row = len(rows)
            begin = seq.num_computed_tokens
            known = len(seq.token_ids)
            spec = drafts.get(seq, ()) if drafts else ()
            if spec:  # its token, then a row of one token for each draft: a decode each, at its position
                rows.append(ScheduledRow(seq, begin, 1))
                rows.extend(ScheduledRow(seq, begin + 1 + j, 1, draft=token) for j, token in enumerate(spec))
            else:
                pending = begin + num_new > known
                rows.append(ScheduledRow(seq, begin, num_new, seq.pending_sample_row if pending else -1))
            seq.num_computed_tokens = computed = begin + num_new
            if seq.request.pooling is not None:
                out.pools.append(PoolTarget(row, seq))
                continue
            if naming:
                self._name_full_blocks(seq)
            if seq.request.needs_prompt_logprobs:
                self._score_prompt(row, seq, begin, computed, out)
            if computed < known + seq.num_pending:
                continue  # a prefill chunk that doesn't reach the end yet
            request = seq.request
            seq.pending_sample_row = len(samples)
            seq.num_pending += 1
            if request.forked or request.params.n == 1:
                samples.append(SampleTarget(row, seq, seq.index, spec))
            else:
                samples.extend(SampleTarget(row, seq, choice) for choice in range(request.params.n))
                request.forked = True

    @staticmethod
    def _score_prompt(row: int, seq: Sequence, begin: int, end: int, out: SchedulerOutput) -> None:
        """Score the prompt positions this row computes that no earlier step scored (a recompute after
        preemption scores nothing twice)."""
        request = seq.request
        first = max(begin, request.num_prompt_positions_scored)
        last = min(end, seq.num_prompt_tokens - 1)
        if last > first:
            out.prompt_scores.append(PromptScoreTarget(row, request, first, last - first))
            request.num_prompt_positions_scored = last

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt from the back of the running list until `seq` can hold `num_tokens`."""
        while not self.block_manager.can_grow(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _admit(self, scheduled: dict[Sequence, int], out: SchedulerOutput, budget: int, images_left: int) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            index = self._pick_waiting()
            if self.max_loras is not None and not self._adapter_fits(self.waiting[index]):
                index = next((i for i, s in enumerate(self.waiting) if self._adapter_fits(s)), -1)
                if index < 0:
                    break  # every waiting sequence needs an adapter beyond max_loras
            seq = self.waiting[index]
            if seq.num_pending:
                break  # preempted with a token in flight: it recomputes once the token is known
            if seq.request.pooling is not None:
                if not self._admit_pooling(seq, budget):
                    break
                for skipped in self.waiting[:index]:
                    skipped.times_overtaken += 1
                self.waiting.pop(index)
                scheduled[seq] = seq.num_tokens
                out.admitted.append(seq)
                budget -= seq.num_tokens
                continue
            # Prompt logprobs need the prompt computed: such a request may fill the cache, not read it.
            reused = 0 if seq.request.needs_prompt_logprobs else self.block_manager.take_cached_prefix(seq)
            seq.num_computed_tokens = reused
            num_new = min(seq.num_uncomputed_tokens, budget)
            computed = 0
            if seq.request.images:
                num_new, computed = self._images_within(seq, num_new, images_left, fresh=True)
            total = seq.num_computed_tokens + num_new
            if not num_new or (not self.block_manager.can_grow(seq, total)
                               and not self._evict_for(seq, total, scheduled, out)):
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
            scheduled[seq] = num_new
            out.admitted.append(seq)
            images_left -= computed
            if out.preempted:  # evictions gave their scheduled tokens back
                budget = self.max_num_batched_tokens - sum(scheduled.values())
            else:
                budget -= num_new

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Running `seq` keeps the running sequences within `max_loras` adapters (vLLM's rule: a waiting
        sequence whose adapter does not fit is passed over, not waited for)."""
        lora_id = seq.request.lora_id
        if not lora_id:
            return True
        running = {s.request.lora_id for s in self.running} - {0}
        assert self.max_loras is not None
        return lora_id in running or len(running) < self.max_loras

    def _admit_pooling(self, seq: Sequence, budget: int) -> bool:
        """Take an embedding request's whole prompt into this step, with blocks for its KV (a decoder's
        layers write it) unless the model keeps none; False when it must wait."""
        num_tokens = seq.num_tokens
        if num_tokens > budget:
            return False
        if self.pooling_needs_kv:
            if not self.block_manager.can_grow(seq, num_tokens):
                return False
            self.block_manager.grow(seq, num_tokens)
        seq.status = SequenceStatus.RUNNING
        return True

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
        best, best_blocks = 0, self._usable_cached_blocks(head)
        for i in range(1, len(self.waiting)):
            seq = self.waiting[i]
            if self._rank(seq) != rank:
                break  # the queue is sorted: nothing after ranks like the head
            blocks = self._usable_cached_blocks(seq)
            if blocks > best_blocks:
                best, best_blocks = i, blocks
        return best

    def _usable_cached_blocks(self, seq: Sequence) -> int:
        request = seq.request
        if request.needs_prompt_logprobs or request.pooling is not None:
            return 0
        return self.block_manager.num_cached_prefix_blocks(seq)

    def _rank(self, seq: Sequence) -> int:
        return seq.request.priority if self.policy == "priority" else 0

    def _note_reuse(self, seq: Sequence, reused: int) -> None:
        seq.num_cached_tokens = reused
        request = seq.request
        first = seq.index == 0 and request.num_cached_tokens is None
        # KV another engine computed for this request (disaggregation) is no cache hit: not in the
        # hit rate, and not billed as cached.
        found = max(0, reused - request.num_imported_tokens) if first else reused
        if self.block_manager.enable_prefix_caching:
            self.block_manager.count_lookup(seq.num_tokens, found)
        if first:
            request.num_cached_tokens = found

    def _evict_for(self, seq: Sequence, num_tokens: int, scheduled: dict[Sequence, int], out: SchedulerOutput) -> bool:
        """Priority policy: a waiting sequence may preempt running ones that rank below it."""
        if self.policy != "priority":
            return False
        while not self.block_manager.can_grow(seq, num_tokens):
            victim = max(self.running, key=self.order, default=None)
            if victim is None or self.order(victim) <= self.order(seq):
                return False
            scheduled.pop(victim, None)
            if victim in out.admitted:
                out.admitted.remove(victim)
            self._preempt(victim, out)
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.release(seq)
        if self.proposer is not None:
            self.proposer.release(seq)
        seq.num_computed_tokens = 0
        seq.request.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        self._enqueue(seq)

    # ---- after the step ---------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: ModelOutput | None) -> list[EngineCoreOutput]:
        """Apply a step's samples: append each token, fork new choices, stop and free what finished,
        and name the blocks that became full in the prefix cache. Sequences that finished or were
        aborted while the step ran just drop their token."""
        outputs: list[EngineCoreOutput] = []
        finished: list[Sequence] = []
        # Fork first: a parent that finishes on its first token would take its blocks with it.
        targets = [self._resolve(target) for target in out.samples]
        row = 0  # the target's first sampling row: a target has one more for each draft it verifies
        for target, seq in zip(out.samples, targets, strict=True):
            if target.drafts:
                row = self._apply_verified(seq, target.drafts, result, row, outputs, finished)
                continue
            if seq is not None:
                assert result is not None
                output = self._append(seq, result, row)
                outputs.append(output)
                if output.finish_reason is not None:
                    finished.append(seq)
            row += 1
        for target, embedding in zip(out.pools, result.embeddings if result is not None else (), strict=True):
            seq = target.seq
            if seq.is_finished:
                continue  # aborted while its step ran
            request = seq.request
            outputs.append(EngineCoreOutput(
                request.request_id, -1, finish_reason="stop", embedding=embedding.tobytes(),
                scheduled_time=request.first_scheduled_time, num_cached_tokens=0,
            ))
            finished.append(seq)
        if self.block_manager.enable_prefix_caching:
            for row in out.rows:
                if not row.seq.is_finished and row.seq.request.pooling is None:
                    self._name_full_blocks(row.seq)
        for seq in finished:
            self._remove(seq)
            if seq.request.is_finished:
                self._forget(seq.request.request_id)
        return outputs

    def _apply_verified(
        self, seq: Sequence | None, drafts: tuple[int, ...], result: ModelOutput | None, row: int,
        outputs: list[EngineCoreOutput], finished: list[Sequence],
    ) -> int:
        """Give `seq` its accepted drafts and the model's token after them, the samples from `row` on (until
        one ends it); returns the row after its samples."""
        end = row + 1 + len(drafts)
        if seq is None:
            return end
        assert result is not None
        accepted = self._accepted(seq, drafts, result.token_ids[row:end])
        seq.num_draft_tokens += len(drafts)
        for sampled in range(row, row + 1 + accepted):
            seq.num_accepted_drafts += sampled < row + accepted  # the last is the model's token after the drafts
            output = self._append(seq, result, sampled)
            outputs.append(output)
            if output.finish_reason is not None:
                finished.append(seq)
                break
        return end

    def _accepted(self, seq: Sequence, drafts: tuple[int, ...], sampled: list[int]) -> int:
        """How many of `seq`'s drafts the model sampled too (a prefix of them); its computed count goes back
        by the others, whose KV does not hold its tokens."""
        accepted = 0
        while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
            accepted += 1
        seq.num_computed_tokens -= len(drafts) - accepted
        self._count_speculation(len(drafts), accepted)
        if accepted:
            seq.draft_misses = 0
            seq.draft_limit = accepted + 1 if accepted < len(drafts) else 2 * len(drafts)
        else:
            seq.draft_misses += 1
            seq.draft_limit = 1
            seq.draft_pause = min(1 << (seq.draft_misses - 1), MAX_DRAFT_PAUSE)
        return accepted

    def _count_speculation(self, num_draft_tokens: int, num_accepted: int) -> None:
        spec = self.spec
        spec.num_drafts += 1
        spec.num_draft_tokens += num_draft_tokens
        spec.num_accepted_tokens += num_accepted
        per_position = spec.accepted_per_position
        if len(per_position) < num_draft_tokens:
            per_position.extend([0] * (num_draft_tokens - len(per_position)))
        for position in range(num_accepted):
            per_position[position] += 1

    def _append(self, seq: Sequence, result: ModelOutput, row: int) -> EngineCoreOutput:
        """Give `seq` the token sampled in `row`; its output, finished if the token ends it."""
        token = result.token_ids[row]
        seq.token_ids.append(token)
        if seq.grammar is not None:
            seq.grammar.accept(token)
        request = seq.request
        output = EngineCoreOutput(request.request_id, token, seq.index)
        if result.logprobs is not None and request.params.logprobs is not None:
            k = request.params.logprobs
            output.logprob = result.logprobs[row]
            output.rank = result.ranks[row]  # type: ignore[index]
            output.top_ids = result.top_logprob_ids[row][:k]  # type: ignore[index]
            output.top_logprobs = result.top_logprobs[row][:k]  # type: ignore[index]
        if request.prediction is not None:
            output.num_draft_tokens, output.num_accepted_drafts = seq.num_draft_tokens, seq.num_accepted_drafts
        if seq.index == 0 and seq.num_output_tokens == 1:  # facts the front end reads once
            output.scheduled_time = request.first_scheduled_time
            output.num_cached_tokens = request.num_cached_tokens or 0
        if self._check_stop(seq, token):
            output.finish_reason, output.stop_reason = seq.finish_reason, seq.stop_reason
            output.num_preemptions = request.num_preemptions
        return output

    def prompt_logprobs_of(self, out: SchedulerOutput, result: ModelOutput | None) -> list[PromptLogprobsChunk]:
        """The step's prompt scores, per request still running (call before `update_from_output`)."""
        if not out.prompt_scores:
            return []
        assert result is not None and result.prompt_logprobs is not None
        scored = result.prompt_logprobs
        chunks = []
        offset = 0
        for target in out.prompt_scores:
            begin, end = offset, offset + target.count
            offset = end
            request = target.request
            if request.request_id not in self.requests:
                continue  # aborted while the step ran
            k = request.params.prompt_logprobs or 0
            chunks.append(PromptLogprobsChunk(
                request.request_id, target.begin + 1, scored.logprobs[begin:end], scored.ranks[begin:end],
                [ids[:k] for ids in scored.top_ids[begin:end]], [lps[:k] for lps in scored.top_logprobs[begin:end]],
            ))
        return chunks

    def _name_full_blocks(self, seq: Sequence) -> None:
        """Name the blocks that are full of scheduled tokens with known ids in the prefix cache (when
        it is on). A block named when its step is scheduled is only read by later steps, which run
        after it."""
        filled = (seq.num_registered_blocks + 1) * self.block_manager.block_size  # its next block is full
        if seq.num_computed_tokens >= filled and len(seq.token_ids) >= filled:
            self.block_manager.register_computed(seq)

    def _resolve(self, target: SampleTarget) -> Sequence | None:
        """The sequence a sample goes to (forking it now for a new choice); None when it is gone."""
        seq = target.seq
        if target.choice == seq.index:
            seq.num_pending -= 1
            return None if seq.is_finished else seq
        if seq.request.request_id not in self.requests:
            return None  # the request was aborted while the step ran
        return self._fork(seq, target.choice)

    def _check_stop(self, seq: Sequence, token: int) -> bool:
        """Finish `seq` if the token it just got ends it (stop strings are the front end's)."""
        params = seq.request.params
        if token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens:
            seq.finish_reason = "length"
        elif self.max_model_len is not None and seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def _fork(self, parent: Sequence, choice: int) -> Sequence:
        """A new choice of an n > 1 request. It shares the prompt's full KV blocks with the parent; the
        partly filled last block, which both would write, is copied (copy-on-write: the runner copies
        it before the next forward pass). With no block free for the copy, the child recomputes it."""
        request = parent.request
        child = Sequence(
            request, choice, list(parent.prompt_token_ids), parent.num_prompt_tokens, request.seed_for_choice(choice)
        )
        bm = self.block_manager
        computed = min(parent.num_prompt_tokens, parent.num_computed_tokens)  # the prompt's KV it holds
        shared = computed // bm.block_size
        bm.share(parent, child, shared)
        child.num_computed_tokens = shared * bm.block_size
        if child.num_computed_tokens < computed:
            dst = bm.allocate_one(child)
            if dst is not None:
                self.pending_copies.append((child, parent.block_table[shared], dst))
                child.num_computed_tokens = computed
        request.seqs.append(child)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        return child

    def take_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write blocks still wanted: their child still runs and still owns the target."""
        copies = [
            (src, dst)
            for child, src, dst in self.pending_copies
            if child.status is SequenceStatus.RUNNING and dst in child.block_table
        ]
        self.pending_copies.clear()
        return copies

    # ---- introspection ----------------------------------------------------------------------------
    def spec_stats(self) -> SpecDecodeStats:
        """A copy of the speculative decoding counts (the live ones go on changing)."""
        spec = self.spec
        return SpecDecodeStats(spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                               list(spec.accepted_per_position))

    def live_sequences(self) -> list[Sequence]:
        return [s for r in self.requests.values() for s in r.seqs if s.status is not SequenceStatus.FINISHED]

    def waiting_by_priority(self) -> list[tuple[int, int, int]]:
        """(priority, waiting sequences, their tokens still to prefill) for each priority that waits, lowest
        first; empty unless the policy is priority (then every waiting sequence is ahead of a new one)."""
        if self.policy != "priority":
            return []
        totals: dict[int, tuple[int, int]] = {}
        for seq in self.waiting:
            count, tokens = totals.get(seq.request.priority, (0, 0))
            totals[seq.request.priority] = (count + 1, tokens + seq.num_uncomputed_tokens)
        return sorted((priority, count, tokens) for priority, (count, tokens) in totals.items())

    def num_pending_prefill_tokens(self) -> int:
        waiting = sum(s.num_uncomputed_tokens for s in self.waiting)
        return waiting + sum(s.num_uncomputed_tokens for s in self.running if s.num_uncomputed_tokens > 1)
