"""The engine core: the scheduler, the block manager and the model runner. Token ids in, one step at
a time, the new token of every running sequence out (vLLM v1's `EngineCore`). It knows no text and
no HTTP; `core_proc` runs it in a process of its own for the server, `LLMEngine` in process.

A step is: the scheduler decides `{sequence: new tokens}`, the core turns that into a plain
`StepBatch`, the runner executes it, and the scheduler applies the samples (`update_from_output`).

With `async_scheduling` (overlapped scheduling, SGLang's overlap scheduler and vLLM's async
scheduling) the core keeps one step in flight: it schedules and launches step N+1 before it reads
step N's samples, so the host's work for N+1 (scheduling, input preparation) and for N (applying
tokens, sending outputs) happens while the device computes. Sampled ids stay on the device and feed
the next step; the host learns them one step later and handles stops then (a sequence that stopped
on step N's token has one more token computed and dropped). On CUDA kernel launches return at once;
on a CPU the host is the device, so a step computes when it is launched and there is nothing to
overlap (a worker thread would only contend for the interpreter lock), but the order of the work is
the same.

Disaggregation (`kv_transfer`): a request whose prompt's KV another engine computed waits here while a
thread pulls it, then joins the scheduler with those blocks in the prefix cache; one whose KV another
engine will read has its prompt's blocks held when it ends (kv_transfer.py). The prefix cache's second
tier (`kv_offload_gib`): before each step the blocks evicted for it are saved there and the blocks taken
from it loaded (kv_offload.py). Under tensor parallelism both read every rank's share of a block through
rank 0 between two steps (a pull's serving thread hands its read to the step loop: `release_kv_exports`).

Speculative decoding (`speculative_config`): the scheduler asks the proposer for drafts as it schedules. A
draft model (draft_model_proposer.py) is a second runner of the core's, its weights loaded before the served
model sizes its KV pool, and its own pool of as many blocks allocated after. A request with a predicted output
(prediction.py) has drafts from it whatever the configuration; while one runs, steps are serial even under
`async_scheduling` (a draft is verified before the next step is scheduled).

Structured output: a request with a grammar waits here until its grammar is compiled (off the step
loop, `structured_output`), then joins the scheduler; each step fills the token bitmask of every
sampling row whose sequence is under a grammar (or `allowed_token_ids`: the same row, ANDed). Under
overlapped scheduling a sequence under a grammar skips a step while its last token is pending (its mask
needs that token), as penalised ones and those with a bad word of several tokens do.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from functools import partial
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from llmserve.config import EngineConfig
from llmserve.engine.block_manager import BlockManager
from llmserve.engine.draft_model_proposer import DraftModelProposer
from llmserve.engine.grammar import grammar_spec
from llmserve.engine.kv_offload import (
    DiskKVTier,
    KVTier,
    MemoryKVTier,
    disk_namespace,
    join_blocks,
    split_blocks,
)
from llmserve.engine.kv_transfer import KVTransfer, PulledKV
from llmserve.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    KVTransferParams,
    StepRecord,
)
from llmserve.engine.model_facts import ModelFacts
from llmserve.engine.ngram_proposer import NgramProposer
from llmserve.engine.parallel_runner import ParallelRunner
from llmserve.engine.prefix_cache import hash_root
from llmserve.engine.proposer import Proposer
from llmserve.engine.scheduler import SampleTarget, ScheduledRow, Scheduler, SchedulerOutput
from llmserve.engine.sequence import Request, Sequence
from llmserve.engine.structured_output import StructuredOutputManager
from llmserve.engine.thinking import ThinkingBudget
from llmserve.engine.wakeup import Wakeup
from llmserve.errors import InvalidRequestError
from llmserve.heap import freeze_startup_heap
from llmserve.model import parallel
from llmserve.model.runner import ImageSlice, ModelRunner, PromptLogprobsBatch, StepBatch, StepHandle
from llmserve.sampling.params import SamplingParams
from llmserve.sampling.sampler import SamplingRow

if TYPE_CHECKING:
    import xgrammar as xgr

    from llmserve.engine.grammar import GrammarState

logger = logging.getLogger(__name__)


@dataclass
class _Launched:
    """A step on the device: what was scheduled, and how to get its samples."""

    scheduled: SchedulerOutput
    handle: StepHandle
    start_time: float


class EngineCore:
    def __init__(self, config: EngineConfig, facts: ModelFacts) -> None:
        self.config = config
        self.facts = facts
        draft_runner = _draft_runner(config, facts)  # its weights loaded before the served model sizes its KV
        runner = ParallelRunner if config.tensor_parallel_size > 1 else ModelRunner
        self.runner = runner(
            config, facts.model_config, facts.model_dir, facts.max_model_len, facts.pooler,
            shared_bytes_per_block=draft_runner.kv_bytes_per_block() if draft_runner is not None else 0,
        )
        pool_tokens = self.runner.num_blocks * config.block_size
        if not self.runner.is_encoder and pool_tokens < facts.max_model_len:
            raise ValueError(
                f"The KV cache holds {pool_tokens} tokens, fewer than max_model_len={facts.max_model_len}; "
                "give it more memory (kv_cache_memory / num_kv_blocks) or lower max_model_len."
            )
        self.tier = self._kv_tier(config, facts)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching,
            tier=self.tier,
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_batched_tokens, config.max_num_seqs, config.scheduling_policy,
            eos_token_ids=facts.eos_token_ids, max_model_len=facts.max_model_len,
            pooling_needs_kv=not self.runner.is_encoder,
            max_loras=config.max_loras if self.runner.lora is not None else None,
            proposer=self._proposer(config, facts, draft_runner),
            fast_step_tokens=self.runner.fast_step_tokens(),
            strict_fast_step=self.runner.compute_bound_past_fast_step(),
            export_kv=self._export_kv,
        )
        # Disaggregation: the side channel other engines pull held KV from, and pull ours from theirs.
        self.kv_transfer = KVTransfer(
            self.runner.read_kv_blocks, self.runner.kv_layout, config.block_size, config.kv_transfer_host,
            config.kv_transfer_port, config.kv_transfer_ttl, reads_on_loop=config.tensor_parallel_size > 1,
        ) if config.kv_transfer else None
        self._awaiting_kv: dict[str, tuple[Request, Future[PulledKV]]] = {}  # requests pulling their prompt's KV
        self._exported: dict[str, KVTransferParams] = {}  # held by this step's update, for its outputs
        # Speculation needs a step's accepted tokens before it schedules the next one.
        speculative = config.speculative
        self.overlapped = config.async_scheduling and speculative is None
        # What else changes the KV of the same tokens (a request's LoRA adapter joins per request).
        self.weights_version = 0  # bumped by each in-place weight reload
        self._cache_identity = self._identity()
        self._arrivals = itertools.count()
        self.num_steps = 0
        self.num_requests_added = 0
        self.last_step: StepRecord | None = None
        self._in_flight: _Launched | None = None
        self._last_end = 0.0
        tokenizer_dir = Path(config.tokenizer) if config.tokenizer and Path(config.tokenizer).is_dir() else facts.model_dir
        self.structured_output = StructuredOutputManager(
            tokenizer_dir, facts.model_config.vocab_size, facts.eos_token_ids
        )
        self._awaiting_grammar: dict[str, tuple[Request, Future]] = {}
        self._failed_outputs: list[EngineCoreOutput] = []  # requests whose grammar failed, to report
        freeze_startup_heap()
        logger.info(
            "engine core ready: %s (%s), %d KV blocks of %d tokens, max_model_len %d, %s scheduling",
            facts.model_config.architecture, self.runner.dtype, self.runner.num_blocks, config.block_size,
            facts.max_model_len, "overlapped" if self.overlapped else "serial",
        )
        if speculative is not None:
            how = (f"draft model {facts.draft.model_dir}" if facts.draft is not None else
                   f"n-grams of {speculative.prompt_lookup_min} to {speculative.prompt_lookup_max} tokens")
            logger.info("speculative decoding: up to %d tokens a step, %s", speculative.num_speculative_tokens, how)

    def _proposer(self, config: EngineConfig, facts: ModelFacts, draft_runner: ModelRunner | None) -> Proposer | None:
        speculative = config.speculative
        if speculative is None:
            return None
        if draft_runner is None:
            return NgramProposer(speculative)
        assert facts.draft is not None
        with parallel.alone():
            draft_runner.allocate_kv_cache(self.runner.num_blocks)
        return DraftModelProposer(speculative, draft_runner, facts.draft.max_model_len, facts.max_num_batched_tokens)

    def _kv_tier(self, config: EngineConfig, facts: ModelFacts) -> KVTier | None:
        """The prefix cache's second tier (`kv_offload_gib`): in host memory, or on disk in `kv_offload_dir`."""
        if not config.kv_offload_gib or self.runner.is_encoder:
            return None
        capacity = int(config.kv_offload_gib * (1 << 30))
        if config.kv_offload_dir is None:
            return MemoryKVTier(capacity)
        namespace = disk_namespace(facts.model_dir, self.runner.kv_layout)
        return DiskKVTier(capacity, Path(config.kv_offload_dir).expanduser() / namespace)

    def _move_offloaded(self) -> None:
        """Before a step: save the blocks evicted for it in the tier (they still hold their old KV), then
        write the KV loaded from the tier into the blocks given it."""
        saves, loads = self.block_manager.take_moves()
        if saves:
            assert self.tier is not None
            blobs = split_blocks(self.runner.read_kv_blocks(list(saves)), len(saves))
            for name, blob in zip(saves.values(), blobs, strict=True):
                self.tier.put(name, blob)
        if loads:
            self.runner.write_kv_blocks(list(loads), join_blocks(loads.values(), self.runner.num_kv_frames))

    def reset_prefix_cache(self) -> tuple[int, int]:
        """Forget every cached block, the pool's (held ones stay with their requests) and the tier's; returns
        how many of each (vLLM's /reset_prefix_cache, for benchmarks and operators)."""
        dropped = self.tier.clear() if self.tier is not None else 0
        return self.block_manager.reset_prefix_cache(), dropped

    def save_cached_blocks(self) -> int:
        """Put every named block of the pool that the tier lacks into it (a disk tier's cache then outlives
        the process); returns how many were saved."""
        if self.tier is None or self.block_manager.cache is None:
            return 0
        named = [(block, entry.block_hash) for block, entry in self.block_manager.cache.by_block.items()
                 if entry.block_hash not in self.tier]
        for start in range(0, len(named), 256):  # bounded host memory for the copies
            chunk = named[start : start + 256]
            blobs = split_blocks(self.runner.read_kv_blocks([block for block, _ in chunk]), len(chunk))
            for (_, name), blob in zip(chunk, blobs, strict=True):
                self.tier.put(name, blob)
        return len(named)

    def _identity(self) -> tuple:
        return (str(self.facts.model_dir), self.config.revision, str(self.runner.dtype), self.weights_version)

    # ---- weights --------------------------------------------------------------------------------
    def read_weights(self, model_dir: str) -> Future:
        """Start reading and checking the checkpoint in `model_dir` on a thread (steps go on meanwhile);
        the future's result goes to `swap_weights`."""
        future: Future = Future()

        def read() -> None:
            try:
                future.set_result(self.runner.read_weights(Path(model_dir)))
            except BaseException as exc:  # reported to the caller, whatever it is
                future.set_exception(exc)

        threading.Thread(target=read, name="llmserve-read-weights", daemon=True).start()
        return future

    def swap_weights(self, model_dir: str, weights: list) -> int:
        """Put read weights in place between two steps. The prefix cache is emptied and requests added
        from now on hash their prompts under a new identity, so no KV of the old weights is reused;
        running requests go on (their KV so far came from the old weights). Returns the cached blocks
        forgotten."""
        self.runner.swap_weights(weights)
        self.facts.model_dir = Path(model_dir)
        self.weights_version += 1
        self._cache_identity = self._identity()
        forgotten = self.block_manager.reset_prefix_cache()
        logger.info("weights from %s in place (version %d); %d cached blocks forgotten", model_dir,
                    self.weights_version, forgotten)
        return forgotten

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the front end validated."""
        request_id = request.request_id
        if request_id in self.scheduler.requests or request_id in self._awaiting_grammar or request_id in self._awaiting_kv:
            raise InvalidRequestError(f"Request id {request_id!r} is already in use.", param="request_id")
        if request.kv_transfer is not None and self.kv_transfer is None:
            raise InvalidRequestError("This engine transfers no KV (start it with --kv-transfer).", param="kv_transfer_params")
        core_request = Request(
            request_id=request_id,
            prompt_token_ids=request.prompt_token_ids,
            params=request.params,
            seed=request.seed,
            arrival_order=next(self._arrivals),
            priority=request.priority,
            cache_root=hash_root(*self._cache_identity, request.cache_salt, request.lora),
            pooling=request.pooling,
            lora=request.lora,
            prediction=_prediction(request.params.prediction_token_ids),
            images=request.images,
        )
        self.num_requests_added += 1
        if request.lora is not None and not self._read_adapter(core_request):
            return
        transfer = request.kv_transfer
        if transfer is not None:
            core_request.export_kv = transfer.do_remote_decode
            if transfer.do_remote_prefill and self._pull_prompt(core_request, transfer):
                return
        self._queue(core_request)

    def _queue(self, core_request: Request) -> None:
        """Into the scheduler, or first to the grammar compiler when it has a grammar."""
        request_id = core_request.request_id
        params = core_request.params
        so = params.structured_outputs
        if so is None:
            if params.thinking_budget is not None:
                core_request.new_grammar = partial(ThinkingBudget, params.thinking_budget)
            self.scheduler.add_request(core_request)
            return
        future = self.structured_output.compile(grammar_spec(so))
        self._awaiting_grammar[request_id] = (core_request, future)
        self._admit_compiled()  # a cached grammar: queued at once

    # ---- KV transfer (disaggregation) -------------------------------------------------------------
    def _export_kv(self, seq: Sequence) -> None:
        """The scheduler's hook as an `export_kv` request ends: hold its prompt's blocks for a pull. Held
        blocks cannot be preempted, so they never take more than half the pool: past that the request
        ends as any other, without a transfer (its decode replica computes the prompt)."""
        assert self.kv_transfer is not None
        held = sum(len(holder.block_table) for holder in self.kv_transfer.holders())
        if held + seq.num_prompt_tokens // self.config.block_size > self.block_manager.num_blocks // 2:
            logger.warning("request %s: its KV is not held for a pull (%d blocks held already)", seq.request.request_id, held)
            return
        self._exported[seq.request.request_id] = self.kv_transfer.hold(seq, self.block_manager)

    def _pull_prompt(self, request: Request, transfer: KVTransferParams) -> bool:
        """Start pulling the prompt blocks this engine's cache lacks; False when there is nothing to pull."""
        assert self.kv_transfer is not None
        probe = Sequence(request, 0, list(request.prompt_token_ids), len(request.prompt_token_ids), request.seed)
        first = self.block_manager.num_cached_prefix_blocks(probe)
        count = (len(request.prompt_token_ids) - 1) // self.config.block_size - first  # the last token is computed here
        if count <= 0 or request.needs_prompt_logprobs or not transfer.remote_host or not transfer.remote_port:
            return False
        adapter = request.lora.lora_name if request.lora is not None else None
        future = self.kv_transfer.pull(transfer.remote_host, transfer.remote_port, transfer.transfer_id or "", first,
                                       count, adapter)
        self._awaiting_kv[request.request_id] = (request, future)
        return True

    def _admit_pulled(self) -> None:
        """Write the KV of the pulls that completed into the cache and queue their requests."""
        ready = [(rid, entry) for rid, entry in self._awaiting_kv.items() if entry[1].done()]
        for request_id, (request, future) in ready:
            del self._awaiting_kv[request_id]
            error = future.exception()
            if error is not None:
                self._pull_failed(request, str(error))
            else:
                self._adopt(request, future.result())
            self._queue(request)

    def _adopt(self, request: Request, pulled: PulledKV) -> None:
        assert self.kv_transfer is not None
        bs = self.config.block_size
        begin, end = pulled.first_block * bs, (pulled.first_block + pulled.num_blocks) * bs
        if pulled.token_ids != request.prompt_token_ids[begin:end]:
            self._pull_failed(request, "the pulled blocks hold other tokens")
            return
        seq = Sequence(request, 0, list(request.prompt_token_ids), len(request.prompt_token_ids), request.seed)
        fresh = self.block_manager.adopt_blocks(seq, pulled.first_block, pulled.num_blocks)
        if fresh is None:
            self._pull_failed(request, "the KV pool has no room for the pulled blocks now")
            return
        if self.tier is not None:
            self._move_offloaded()  # the tier's blocks loaded, and what the fresh ones held saved before the write
        try:
            self.runner.write_kv_blocks(fresh, pulled.frames)
        except ValueError as exc:
            self.block_manager.release(seq)
            self._pull_failed(request, str(exc))
            return
        seq.num_computed_tokens = end
        self.block_manager.register_computed(seq)
        self.block_manager.release(seq)
        request.num_imported_tokens = end
        self.kv_transfer.counts.blocks_received += pulled.num_blocks

    def _pull_failed(self, request: Request, reason: str) -> None:
        assert self.kv_transfer is not None
        self.kv_transfer.counts.pulls_failed += 1
        logger.warning("request %s: its prompt's KV could not be pulled (%s); computing it here", request.request_id, reason)

    def release_kv_exports(self) -> bool:
        """Read the held KV a pull waits for (under tensor parallelism), and let go of held KV that was pulled,
        or that nobody pulled in time; True when some was."""
        if self.kv_transfer is None:
            return False
        self.kv_transfer.serve_reads()
        return self.kv_transfer.release_done(self.block_manager)

    def seconds_to_next_kv_expiry(self) -> float | None:
        """How long the step loop may sleep before held KV must be let go; None: as long as it likes."""
        deadline = self.kv_transfer.next_deadline() if self.kv_transfer is not None else None
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    @property
    def wakeup_fds(self) -> list[int]:
        """Readable when work done off the step loop completed: a grammar compiled, a KV pull or serve ended."""
        return [wakeup.fd for wakeup in self._wakeups()]

    def clear_wakeups(self) -> None:
        for wakeup in self._wakeups():
            wakeup.clear()

    def _wakeups(self) -> list[Wakeup]:
        wakeups = [self.structured_output.wakeup]
        return wakeups + [self.kv_transfer.wakeup] if self.kv_transfer is not None else wakeups

    def _read_adapter(self, request: Request) -> bool:
        """Have the request's LoRA adapter read (the front end checked it; its files may have changed since);
        False when it cannot be: the request then fails."""
        assert request.lora is not None
        try:
            if self.runner.lora is None:
                raise InvalidRequestError("LoRA adapters are not enabled.")
            self.runner.lora.add(request.lora, self._adapters_named)
        except InvalidRequestError as exc:
            logger.warning("request %s: its LoRA adapter %r cannot be used: %s", request.request_id,
                           request.lora.lora_name, exc)
            self._failed_outputs.extend(
                EngineCoreOutput(request.request_id, -1, index, finish_reason="error") for index in range(request.params.n)
            )
            return False
        return True

    def _adapters_named(self) -> set[int]:
        """The adapter ids of every live request (queued, or waiting for its grammar)."""
        waiting = (r for r, _ in self._awaiting_grammar.values())
        return {r.lora_id for r in chain(self.scheduler.requests.values(), waiting)}

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar is ready; finish those whose grammar failed to compile."""
        if not self._awaiting_grammar:
            return
        ready = [(rid, entry) for rid, entry in self._awaiting_grammar.items() if entry[1].done()]
        for request_id, (request, future) in ready:
            del self._awaiting_grammar[request_id]
            error = future.exception()
            if error is not None:
                logger.warning("request %s: its grammar failed to compile: %s", request_id, error)
                self._failed_outputs.extend(
                    EngineCoreOutput(request_id, -1, index, finish_reason="error") for index in range(request.params.n)
                )
                continue
            request.new_grammar = partial(self._constraint, request.params, future.result())
            self.scheduler.add_request(request)

    def _constraint(self, params: SamplingParams, compiled: xgr.CompiledGrammar) -> GrammarState | ThinkingBudget:
        """A fresh sequence's grammar, inside its thinking budget when it has one."""
        so = params.structured_outputs
        assert so is not None
        grammar = self.structured_output.new_state(compiled, so.start_after)
        return grammar if params.thinking_budget is None else ThinkingBudget(params.thinking_budget, grammar)

    def wait_for_pending(self, timeout: float | None = None) -> None:
        """Block until some awaited grammar is compiled or KV pull ended (or `timeout`); returns at once with
        none awaited."""
        futures = [future for _, future in chain(self._awaiting_grammar.values(), self._awaiting_kv.values())]
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Stop requests wherever they are; their blocks return to the pool at once."""
        for request_id in request_ids:
            self._awaiting_grammar.pop(request_id, None)
            self._awaiting_kv.pop(request_id, None)  # its pull ends on its own; nothing was taken for it
        self.scheduler.finish_requests(request_ids)

    def stop_choices(self, choices: list[tuple[str, int]]) -> None:
        """End the choices that stop strings ended in the front end."""
        self.scheduler.finish_choices(choices)

    def has_work(self) -> bool:
        """Some request is unfinished (its grammar may still be compiling, its prompt's KV being pulled) or a
        step is in flight."""
        return self.can_step() or bool(self._awaiting_grammar) or bool(self._awaiting_kv)

    def can_step(self) -> bool:
        """A step would do something now; False when the only requests left wait for their grammar or KV pull."""
        return (
            self.scheduler.has_unfinished() or self._in_flight is not None or bool(self._failed_outputs)
            or any(future.done() for _, future in chain(self._awaiting_grammar.values(), self._awaiting_kv.values()))
        )

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs | None:
        """Run one step; return the outputs of the step that completed (None when none did)."""
        self.release_kv_exports()
        if self._awaiting_kv:
            self._admit_pulled()
        self._admit_compiled()
        if self.overlapped and not self.scheduler.num_predicting:
            outputs = self._step_overlapped()
        elif self._in_flight is not None:  # drafts (a prediction's) are verified in serial steps: end overlap first
            outputs, self._in_flight = self._complete(self._in_flight), None
        else:
            launched = self._launch()
            outputs = None if launched is None else self._complete(launched)
        if self._failed_outputs:
            failed, self._failed_outputs = self._failed_outputs, []
            if outputs is None:
                return EngineCoreOutputs(failed, None, self.stats())
            outputs.outputs.extend(failed)
        return outputs

    def _step_overlapped(self) -> EngineCoreOutputs | None:
        previous, self._in_flight = self._in_flight, self._launch()
        return None if previous is None else self._complete(previous)

    def _launch(self) -> _Launched | None:
        start = time.monotonic()
        scheduled = self.scheduler.schedule()
        if self.tier is not None:
            self._move_offloaded()
        if not scheduled:
            return None
        for seq in scheduled.admitted:
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = start
        return _Launched(scheduled, self.runner.execute(self.build_step_batch(scheduled)), start)

    def _complete(self, launched: _Launched) -> EngineCoreOutputs:
        result = launched.handle.result()
        prompt_logprobs = self.scheduler.prompt_logprobs_of(launched.scheduled, result)
        outputs = self.scheduler.update_from_output(launched.scheduled, result)
        if self._exported:
            self._attach_exports(outputs)
        end = time.monotonic()
        # Under overlap a step's host work hides behind the previous one: it took from the later of
        # its launch and the previous step's end.
        self._record_step(max(launched.start_time, self._last_end), end, launched.scheduled)
        self._last_end = end
        return EngineCoreOutputs(outputs, self.last_step, self.stats(), prompt_logprobs)

    def _attach_exports(self, outputs: list[EngineCoreOutput]) -> None:
        """Each request whose KV this step's update held tells, on its last output, where it is."""
        for output in outputs:
            if output.finish_reason is not None and (params := self._exported.pop(output.request_id, None)):
                output.kv_transfer = params
        self._exported.clear()  # aborted meanwhile: nobody learns the transfer id, it expires

    def _record_step(self, start: float, end: float, scheduled: SchedulerOutput) -> None:
        rows = scheduled.rows
        num_decodes = sum(1 for row in rows if row.num_new == 1 and row.draft < 0)  # a draft's row is its sequence's
        num_tokens = scheduled.num_batched_tokens
        self.num_steps += 1
        self.last_step = StepRecord(
            start_time=start,
            end_time=end,
            num_tokens=num_tokens,
            num_prefill_tokens=num_tokens - sum(1 for row in rows if row.num_new == 1),
            num_seqs=sum(1 for row in rows if row.draft < 0),
            num_decodes=num_decodes,
            num_preempted=len(scheduled.preempted),
        )

    # ---- the plain step batch -------------------------------------------------------------------
    def build_step_batch(self, scheduled: SchedulerOutput) -> StepBatch:
        rows = scheduled.rows
        count = len(rows)
        num_new = np.fromiter((row.num_new for row in rows), dtype=np.int64, count=count)
        begins = np.fromiter((row.begin for row in rows), dtype=np.int64, count=count)
        starts = np.cumsum(num_new) - num_new
        pending = [(int(starts[i]) + row.num_new - 1, row.pending_source)
                   for i, row in enumerate(rows) if row.pending_source >= 0]
        total = int(num_new.sum())
        # One sampling row per target, and one more per draft it verifies (in the draft's row).
        sampled = [(target, ahead) for target in scheduled.samples for ahead in range(len(target.drafts) + 1)]
        mask_rows, bitmask = self._token_bitmask([target.seq for target, _ in sampled])
        if total == count:  # decodes only: one token each
            tokens = (
                row.draft if row.draft >= 0 else row.seq.token_ids[row.begin] if row.pending_source < 0 else 0
                for row in rows
            )
        else:
            tokens = chain.from_iterable(_row_tokens(row) for row in rows)
        input_ids = np.fromiter(tokens, dtype=np.int64, count=total)
        with_images = [(row, start) for row, start in zip(rows, starts.tolist(), strict=True) if row.seq.request.images]
        return StepBatch(
            input_ids=input_ids,
            num_computed=begins,
            num_new=num_new,
            block_tables=[row.seq.block_table for row in rows],
            logits_rows=[target.row + ahead for target, ahead in sampled],
            sampling_rows=[
                self._sampling_row(target, None if bitmask is None or i not in mask_rows else bitmask[mask_rows[i]], ahead)
                for i, (target, ahead) in enumerate(sampled)
            ],
            pending_index=np.array([i for i, _ in pending], dtype=np.int64) if pending else None,
            pending_source=np.array([s for _, s in pending], dtype=np.int64) if pending else None,
            blocks_to_copy=self.scheduler.take_copies(),
            prompt_logprobs=_prompt_logprobs_batch(scheduled, starts) if scheduled.prompt_scores else None,
            mask_rows=np.fromiter(mask_rows, dtype=np.int64, count=len(mask_rows)) if mask_rows else None,
            token_bitmask=bitmask,
            pool_rows=[target.row for target in scheduled.pools],
            pool_dimensions=[target.seq.request.pooling.dimensions for target in scheduled.pools],  # type: ignore[union-attr]
            pool_second_texts=[target.seq.request.pooling.second_text_start for target in scheduled.pools],  # type: ignore[union-attr]
            lora_ids=[row.seq.request.lora_id for row in rows] if self.runner.lora is not None else [],
            images=[piece for row, start in with_images for piece in _image_slices(row, start)],
            position_shifts=_position_shifts(with_images, total) if with_images else None,
        )

    def _token_bitmask(self, sampled: list[Sequence]) -> tuple[dict[int, int], np.ndarray | None]:
        """{sampling row: bitmask row} of the rows under a grammar or `allowed_token_ids`, and their
        packed allowed tokens (both constraints at once: the tokens both allow). The unforked choices of
        an n > 1 request all start from its first sequence's state; a sequence under a grammar has no drafts."""
        constrained = [i for i, seq in enumerate(sampled) if _is_constrained(seq)]
        if not constrained:
            return {}, None
        bitmask = self.structured_output.new_bitmask(len(constrained))
        for j, i in enumerate(constrained):
            seq = sampled[i]
            if seq.grammar is not None and seq.grammar.constrains:
                seq.grammar.fill_bitmask(bitmask, j)
            else:
                bitmask[j] = -1
            request = seq.request
            if request.params.allowed_token_ids is not None:
                if request.allowed_mask is None:
                    request.allowed_mask = _packed(request.params.allowed_token_ids, bitmask.shape[1])
                bitmask[j] &= request.allowed_mask
        return {i: j for j, i in enumerate(constrained)}, bitmask

    def _sampling_row(self, target: SampleTarget, allowed: np.ndarray | None, ahead: int = 0) -> SamplingRow:
        """How to sample `target` (`ahead` > 0: after that many of its drafts, as if they were its tokens);
        `allowed`: its packed allowed tokens (grammar, allowed_token_ids), when it has them."""
        seq, choice = target.seq, target.choice
        params = seq.request.params
        num_outputs = seq.num_output_tokens + seq.num_pending - 1 + ahead  # before this sample's token
        token_ids = seq.token_ids if not ahead else [*seq.token_ids, *target.drafts[:ahead]]
        banned: tuple[int, ...] = ()
        if num_outputs < params.min_tokens:
            request = seq.request
            if request.min_tokens_banned is None:
                request.min_tokens_banned = tuple(sorted(self.facts.eos_token_ids | set(params.stop_token_ids)))
            banned = request.min_tokens_banned
            if allowed is not None and not _allows_other_than(allowed, banned):
                banned = ()  # the grammar allows only an end: it wins over min_tokens
        if params.bad_words_token_ids:
            banned += _bad_word_ends(params.bad_words_token_ids, token_ids, seq.num_output_tokens + ahead)
        narrowed = bool(banned) or params.allowed_token_ids is not None  # a grammar alone always allows a token
        if allowed is not None and narrowed and not _allows_other_than(allowed, banned):
            # The request's own constraints leave no token (allowed_token_ids against its grammar or its
            # bad words): the choice ends there, as the model would end it, rather than sample one of them.
            allowed[:] = _packed(sorted(self.facts.eos_token_ids), len(allowed))
            banned = ()
        return SamplingRow(
            params=params,
            seed=seq.seed if choice == seq.index else seq.request.seed_for_choice(choice),
            sample_index=num_outputs,
            prompt_token_ids=seq.prompt_token_ids if params.penalised else (),
            output_token_ids=token_ids[seq.num_prompt_tokens:] if params.penalised else (),
            banned_token_ids=banned,
        )

    # ---- introspection --------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm, scheduler = self.block_manager, self.scheduler
        return EngineStats(
            num_running=scheduler.num_running,
            num_waiting=scheduler.num_waiting + len(self._awaiting_grammar) + len(self._awaiting_kv),
            num_unfinished_requests=len(scheduler.requests) + len(self._awaiting_grammar) + len(self._awaiting_kv),
            num_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            num_used_blocks=bm.num_used_blocks,
            kv_cache_usage=bm.usage,
            num_preemptions=scheduler.num_preemptions,
            num_cached_blocks=bm.num_cached_blocks,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            num_steps=self.num_steps,
            num_pending_prefill_tokens=scheduler.num_pending_prefill_tokens(),
            num_requests_added=self.num_requests_added,
            waiting_by_priority=scheduler.waiting_by_priority(),
            spec_decode=scheduler.spec_stats() if scheduler.proposer is not None or scheduler.spec.num_drafts else None,
            **(self._adapters_in_use() if self.runner.lora is not None else {}),
            **(self._kv_transfer_stats() if self.kv_transfer is not None else {}),
            **(self._kv_offload_stats() if self.tier is not None else {}),
        )

    def _kv_offload_stats(self) -> dict[str, int]:
        assert self.tier is not None
        return {"kv_offload_saved": self.tier.saved, "kv_offload_loaded": self.tier.loaded,
                "kv_offload_blocks": len(self.tier), "kv_offload_bytes": self.tier.num_bytes}

    def _kv_transfer_stats(self) -> dict[str, int]:
        assert self.kv_transfer is not None
        counts = self.kv_transfer.counts
        return {
            "kv_blocks_sent": counts.blocks_sent, "kv_blocks_received": counts.blocks_received,
            "kv_pulls_failed": counts.pulls_failed, "kv_exports_expired": counts.exports_expired,
            "kv_blocks_held": sum(len(holder.block_table) for holder in self.kv_transfer.holders()),
        }

    def _adapters_in_use(self) -> dict[str, list[str]]:
        """vLLM's `lora_requests_info`: the adapters of the running and of the waiting requests."""
        def names(seqs: list[Sequence]) -> list[str]:
            return sorted({s.request.lora.lora_name for s in seqs if s.request.lora is not None})

        return {"running_loras": names(self.scheduler.running), "waiting_loras": names(self.scheduler.waiting)}

    def live_sequences(self) -> list[Sequence]:
        """Every sequence holding blocks: the scheduler's, and the holders of KV kept for other engines."""
        held = self.kv_transfer.holders() if self.kv_transfer is not None else []
        return self.scheduler.live_sequences() + held

    def check_invariants(self) -> None:
        """Block accounting is exact: every block is free or owned, ref counts equal owners; a draft model's
        blocks are free or held by one live sequence."""
        live = self.live_sequences()
        self.block_manager.check_invariants(live)
        if isinstance(proposer := self.scheduler.proposer, DraftModelProposer):
            proposer.check_invariants(live)

    def shutdown(self) -> None:
        """Drop every request (their blocks return to the pool) and let the step in flight end."""
        self._awaiting_grammar.clear()
        self._awaiting_kv.clear()
        self.scheduler.finish_requests(list(self.scheduler.requests))
        if self._in_flight is not None:
            self._in_flight.handle.result()
            self._in_flight = None
        if self.kv_transfer is not None:
            self.kv_transfer.close(self.block_manager)
        if isinstance(self.tier, DiskKVTier):
            logger.info("KV offload: %d cached blocks saved to %s", self.save_cached_blocks(), self.tier.directory)
        self.structured_output.shutdown()
        if isinstance(self.runner, ParallelRunner):
            self.runner.close()


def _prediction(token_ids: list[int] | None) -> np.ndarray | None:
    return np.asarray(token_ids, dtype=np.int64) if token_ids else None


def _is_constrained(seq: Sequence) -> bool:
    """Whether a sequence samples from a subset of the vocabulary: a grammar's, or `allowed_token_ids`."""
    return (seq.grammar is not None and seq.grammar.constrains) or seq.request.params.allowed_token_ids is not None


def _packed(token_ids: list[int], width: int) -> np.ndarray:
    """Token ids as a packed bitmask row (bit j of word w: token 32 * w + j), as the grammars fill them."""
    ids = np.asarray(token_ids, dtype=np.int64)
    words = np.zeros(width, dtype=np.uint32)
    np.bitwise_or.at(words, ids // 32, np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
    return words.view(np.int32)


def _bad_word_ends(words: list[list[int]], token_ids: list[int], num_outputs: int) -> tuple[int, ...]:
    """The last token of each bad word whose other tokens end the output so far (vLLM's rule: the
    prompt does not count)."""
    ends = []
    for word in words:
        before = len(word) - 1
        if before == 0 or (before <= num_outputs and token_ids[-1] == word[-2] and token_ids[-before:] == word[:-1]):
            ends.append(word[-1])
    return tuple(ends)


def _allows_other_than(bitmask_row: np.ndarray, banned: tuple[int, ...]) -> bool:
    """Whether a packed allowed-token row allows some token outside `banned`."""
    row = bitmask_row.copy()
    ids = np.fromiter(banned, dtype=np.int64, count=len(banned))
    ids = ids[ids < 32 * len(row)]
    np.bitwise_and.at(row, ids // 32, ~(np.int32(1) << (ids % 32).astype(np.int32)))
    return bool(row.any())


def _prompt_logprobs_batch(scheduled: SchedulerOutput, starts: np.ndarray) -> PromptLogprobsBatch:
    """Where the scored prompt positions sit among the step's tokens, and the token each one scores."""
    index: list[np.ndarray] = []
    targets: list[int] = []
    for target in scheduled.prompt_scores:
        row = scheduled.rows[target.row]
        first = int(starts[target.row]) + target.begin - row.begin
        index.append(np.arange(first, first + target.count, dtype=np.int64))
        targets += target.request.prompt_token_ids[target.begin + 1 : target.begin + 1 + target.count]
    num_top = max(target.request.params.prompt_logprobs or 0 for target in scheduled.prompt_scores)
    return PromptLogprobsBatch(np.concatenate(index), np.array(targets, dtype=np.int64), num_top)


def _image_slices(row: ScheduledRow, batch_start: int) -> list[ImageSlice]:
    """The parts of its request's images whose placeholders a row computes, where they are in the step."""
    if row.draft >= 0:
        return []
    begin, end = row.begin, row.begin + row.num_new
    return [
        ImageSlice(image.digest, image.pixel_array(), image.size, batch_start + lo - begin, lo - image.offset, hi - lo,
                   image.length)
        for image in row.seq.request.images
        if (lo := max(begin, image.offset)) < (hi := min(end, image.offset + image.length))
    ]


def _position_shifts(rows: list[tuple[ScheduledRow, int]], total: int) -> np.ndarray | None:
    """How far each token's position lags its index where images moved them on by other than their tokens (Qwen2-VL's
    M-RoPE: an image takes its grid's longer side), given the rows with images and where each starts; None where none
    did. An image's own tokens lag as the first."""
    shifts = None
    for row, start in rows:
        request = row.seq.request
        if not request.position_lag:
            continue
        if shifts is None:
            shifts = np.zeros(total, dtype=np.int64)
        if row.begin >= request.images_end:  # past every image (every decode): the whole lag
            shifts[start : start + row.num_new] = request.position_lag
            continue
        images = request.images
        ends = np.array([image.offset + image.length for image in images])
        lags = np.cumsum([0] + [image.shift for image in images])
        indexes = np.arange(row.begin, row.begin + row.num_new)
        shifts[start : start + row.num_new] = lags[np.searchsorted(ends, indexes, side="right")]
    return shifts


def _row_tokens(row: ScheduledRow) -> list[int]:
    """A row's new tokens: a draft's, or a pending last one (not known on the host yet) as a 0 placeholder."""
    if row.draft >= 0:
        return [row.draft]
    tokens = row.seq.token_ids[row.begin : row.begin + row.num_new]
    return tokens if len(tokens) == row.num_new else tokens + [0]


def _draft_runner(config: EngineConfig, facts: ModelFacts) -> ModelRunner | None:
    """Speculative decoding's draft model, loaded without its KV pool (it takes as many blocks as the served
    model's, allocated once that is sized): unquantized unless its checkpoint is, no adapters."""
    if facts.draft is None:
        return None
    draft = facts.draft
    draft_config = dataclasses.replace(
        config, model=str(draft.model_dir), tokenizer=None, revision=None, speculative_config=None, lora_modules=None,
        enable_lora=False, quantization=None, quantize_lm_head=False, hf_overrides=None, kv_transfer=False,
        kv_offload_gib=0.0, kv_offload_dir=None, task="generate", pooling=None,
    )
    with parallel.alone():  # whole on rank 0 beside a served model split over tensor-parallel ranks
        return ModelRunner(draft_config, draft.model_config, draft.model_dir, draft.max_model_len, defer_kv_cache=True)
