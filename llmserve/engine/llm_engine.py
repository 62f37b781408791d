"""The synchronous engine: requests in, one scheduled forward pass per `step()`, outputs out.

It owns the scheduler, the block manager and the model runner, and knows nothing of HTTP: the async
front end and the offline `LLM` class both drive it.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import functools
import gc
import itertools
import json
import logging
import random
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

from llmserve.config import EngineConfig
from llmserve.engine.block_manager import BlockManager
from llmserve.engine.output_processor import StopChecker, completion_output
from llmserve.engine.prefix_cache import hash_root
from llmserve.engine.scheduler import Scheduler
from llmserve.engine.sequence import Request, Sequence, SequenceStatus
from llmserve.errors import ContextLengthExceededError, InvalidRequestError
from llmserve.model.config import ModelConfig
from llmserve.model.loader import resolve_model_path
from llmserve.model.registry import model_class
from llmserve.model.runner import ModelRunner
from llmserve.outputs import RequestMetrics, RequestOutput
from llmserve.sampling.params import RequestOutputKind, SamplingParams
from llmserve.sampling.sampler import SamplerOutput, SamplingRow
from llmserve.tokenizer.detokenizer import IncrementalDetokenizer
from llmserve.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_unfinished_requests: int
    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    num_cached_blocks: int = 0  # blocks named in the prefix cache (held or evictable)
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache at admissions
    prefix_cache_hits: int = 0  # of which found cached
    num_steps: int = 0
    num_pending_prefill_tokens: int = 0  # tokens still to prefill (waiting, and running prompt chunks)


@dataclass(frozen=True)
class StepRecord:
    """What one step did, with its timestamps (time.monotonic seconds); for metrics and load estimates."""

    start_time: float
    end_time: float
    num_tokens: int  # tokens in the forward pass
    num_prefill_tokens: int  # of which in prompt (or recompute) chunks
    num_seqs: int
    num_decodes: int  # sequences computing one token
    num_preempted: int

    @property
    def duration(self) -> float:
        return self.end_time - self.start_time


def _freeze_startup_heap() -> None:
    """Move every object alive now (modules, weights' wrappers, tokenizer and template tables: the
    engine's lifetime) out of the cyclic collector's reach. Otherwise each full collection walks
    them all: at batch 256 that was a ~100 ms stall every few dozen steps, ~2 ms a step on average.
    Freed objects still go by reference counting; vLLM's engine core does the same. At exit they are
    handed back, so the interpreter's last collection sees them (extensions check for leaks then)."""
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.model_dir = resolve_model_path(config.model, config.revision)
        self.model_config = ModelConfig.from_pretrained(self.model_dir)
        model_class(self.model_config.architecture)  # fail fast on an unsupported architecture
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or self.model_dir)
        self.generation_config = _read_json(self.model_dir / "generation_config.json")
        self.eos_token_ids = self._eos_token_ids()
        self.max_model_len = self._max_model_len()
        self.runner = ModelRunner(config, self.model_config, self.model_dir, self.max_model_len)
        pool_tokens = self.runner.num_blocks * config.block_size
        if pool_tokens < self.max_model_len:
            raise ValueError(
                f"The KV cache holds {pool_tokens} tokens, fewer than max_model_len={self.max_model_len}; "
                "give it more memory (kv_cache_memory / num_kv_blocks) or lower max_model_len."
            )
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        # What else changes the KV of the same tokens; a LoRA adapter would join per request.
        self._cache_identity = (str(self.model_dir), config.revision, str(self.runner.dtype))
        self._pending_copies: list[tuple[Sequence, int, int]] = []  # (child, src, dst) copy-on-write
        self.last_step: StepRecord | None = None
        self.num_steps = 0
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_batched_tokens, config.max_num_seqs, config.scheduling_policy
        )
        self.stop_checker = StopChecker(self.eos_token_ids, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(config.seed)
        self._arrivals = itertools.count()
        _freeze_startup_heap()
        logger.info(
            "engine ready: %s (%s), %d KV blocks of %d tokens, max_model_len %d",
            self.model_config.architecture, self.runner.dtype, self.runner.num_blocks,
            config.block_size, self.max_model_len,
        )

    @classmethod
    def from_args(cls, model: str, **kwargs) -> LLMEngine:
        return cls(EngineConfig(model=model, **kwargs))

    # ---- configuration helpers ------------------------------------------------------------------
    def _eos_token_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        gen_eos = self.generation_config.get("eos_token_id")
        ids.update([gen_eos] if isinstance(gen_eos, int) else gen_eos or [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        if self.model_config.sliding_window:
            limit = min(limit, self.model_config.sliding_window)
        if self.config.max_model_len is None:
            return limit
        if self.config.max_model_len > limit:
            raise ValueError(f"max_model_len {self.config.max_model_len} exceeds the model's limit of {limit}.")
        return self.config.max_model_len

    def default_sampling_params(self) -> SamplingParams:
        """vLLM's behaviour: the checkpoint's generation_config supplies default sampling settings."""
        gen = self.generation_config
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        overrides = {k: gen[k] for k in keys if k in gen and (gen.get("do_sample", True) or k == "repetition_penalty")}
        return SamplingParams(**overrides)

    # ---- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Validate and queue a request. Raises InvalidRequestError; the engine state is untouched then."""
        if request_id in self.requests:
            raise InvalidRequestError(f"Request id {request_id!r} is already in use.", param="request_id")
        params = params or self.default_sampling_params()
        text = prompt if isinstance(prompt, str) else None
        if text == "":
            raise InvalidRequestError("The prompt is empty.", param="prompt")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string.", param="cache_salt")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = self._validate(token_ids, params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        request = Request(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=token_ids,
            params=params,
            seed=seed,
            arrival_order=next(self._arrivals),
            metrics=RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.monotonic()),
            priority=priority,
            cache_root=hash_root(*self._cache_identity, cache_salt),
        )
        seq = self._new_sequence(request, 0, list(token_ids))
        request.seqs.append(seq)
        self.requests[request_id] = request
        self.scheduler.add(seq)
        return request

    def _validate(self, token_ids: list[int], params: SamplingParams) -> SamplingParams:
        if not token_ids:
            raise InvalidRequestError("The prompt is empty.", param="prompt")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"Prompt token ids must be integers in [0, {vocab}).", param="prompt")
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be below the vocabulary size {vocab}.", param="stop_token_ids")
        n_prompt, limit = len(token_ids), self.max_model_len
        if n_prompt >= limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens, but the prompt has {n_prompt} tokens "
                "(at least one more is needed for the output).",
                param="prompt",
            )
        if params.max_tokens is None:
            return dataclasses.replace(params, max_tokens=limit - n_prompt)
        if n_prompt + params.max_tokens > limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n_prompt + params.max_tokens} tokens ({n_prompt} in the prompt, {params.max_tokens} for the "
                "completion). Please reduce the prompt or max_tokens.",
                param="max_tokens",
            )
        return params

    def _new_sequence(self, request: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(request, index, token_ids, len(request.prompt_token_ids), request.seed_for_choice(index))
        seq.detokenizer = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.params.skip_special_tokens
        )
        return seq

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Stop requests wherever they are; their blocks return to the pool at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for request_id in ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            for seq in request.seqs:
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    self.scheduler.remove(seq)
            request.metrics.finished_time = time.monotonic()
            outputs.append(self._request_output(request))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample, and report every request that made progress."""
        start = time.monotonic()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        for seq in scheduled.admitted:
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = start
        # Decodes (one new token) lead the batch; sort is stable so scheduling order is kept.
        batch = sorted(scheduled.scheduled.items(), key=lambda item: item[1] != 1)
        logits_rows, rows, targets = self._sampling_plan(batch)
        result = self.runner.execute(batch, logits_rows, rows, self._take_copies())
        block_size = self.block_manager.block_size
        for seq, num_new in batch:
            seq.num_computed_tokens += num_new
            if seq.num_computed_tokens >= (seq.num_registered_blocks + 1) * block_size:  # a block filled up
                self.block_manager.register_computed(seq)
        touched = self._apply_samples(targets, result) if result is not None else []
        outputs = [output for request in touched if (output := self._finish_if_done(request)) is not None]
        self._record_step(start, batch, len(scheduled.preempted))
        return outputs

    def _take_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write blocks still wanted: their child still runs and still owns the target."""
        copies = [
            (src, dst)
            for child, src, dst in self._pending_copies
            if child.status is SequenceStatus.RUNNING and dst in child.block_table
        ]
        self._pending_copies.clear()
        return copies

    def _record_step(self, start: float, batch: list[tuple[Sequence, int]], num_preempted: int) -> None:
        num_decodes = sum(1 for _, n in batch if n == 1)
        num_tokens = sum(n for _, n in batch)
        self.num_steps += 1
        self.last_step = StepRecord(
            start_time=start,
            end_time=time.monotonic(),
            num_tokens=num_tokens,
            num_prefill_tokens=num_tokens - num_decodes,
            num_seqs=len(batch),
            num_decodes=num_decodes,
            num_preempted=num_preempted,
        )

    def _sampling_plan(
        self, batch: list[tuple[Sequence, int]]
    ) -> tuple[list[int], list[SamplingRow], list[tuple[Sequence, int]]]:
        """Which sequences get a new token this step: those whose scheduled tokens reach their end.
        A request with n > 1 samples all its choices from its prompt's logits, then forks."""
        logits_rows: list[int] = []
        rows: list[SamplingRow] = []
        targets: list[tuple[Sequence, int]] = []
        for i, (seq, num_new) in enumerate(batch):
            if seq.num_computed_tokens + num_new < len(seq.token_ids):
                continue  # a prefill chunk that doesn't reach the end yet
            request = seq.request
            choices = (seq.index,) if request.params.n == 1 or request.forked else range(request.params.n)
            for choice in choices:
                logits_rows.append(i)
                rows.append(self._sampling_row(seq, choice))
                targets.append((seq, choice))
        return logits_rows, rows, targets

    def _sampling_row(self, seq: Sequence, choice: int) -> SamplingRow:
        params = seq.request.params
        penalised = (
            params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1
        )
        banned: list[int] = []
        if seq.num_output_tokens < params.min_tokens:
            banned = sorted(self.eos_token_ids | set(params.stop_token_ids))
        return SamplingRow(
            params=params,
            seed=seq.seed if choice == seq.index else seq.request.seed_for_choice(choice),
            sample_index=len(seq.token_ids) - seq.num_prompt_tokens,
            prompt_token_ids=seq.prompt_token_ids if penalised else (),
            output_token_ids=seq.output_token_ids if penalised else (),
            banned_token_ids=banned,
        )

    def _apply_samples(self, targets: list[tuple[Sequence, int]], result: SamplerOutput) -> list[Request]:
        token_ids = result.token_ids.tolist()  # the one device->host sync of the step
        chosen_lp = result.logprobs.tolist() if result.logprobs is not None else None
        top_ids = result.top_logprob_ids.tolist() if result.top_logprob_ids is not None else None
        top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        now = time.monotonic()
        touched: dict[str, Request] = {}
        # Fork first: a parent that finishes on its first token would take its blocks with it.
        resolved = [seq if choice == seq.index else self._fork(seq, choice) for seq, choice in targets]
        for row, target in enumerate(resolved):
            request = target.request
            logprobs = None
            if chosen_lp is not None and target.logprobs is not None:
                k = request.params.logprobs or 0
                logprobs = dict(zip(top_ids[row][:k], top_lp[row][:k], strict=True))
                logprobs[token_ids[row]] = chosen_lp[row]
                target.cumulative_logprob += chosen_lp[row]
            self._append_token(target, token_ids[row], logprobs, now)
            touched[request.request_id] = request
        for request in touched.values():
            request.forked = True
        return list(touched.values())

    def _fork(self, parent: Sequence, choice: int) -> Sequence:
        """A new choice of an n > 1 request. It shares the prompt's full KV blocks with the parent; the
        partly filled last block, which both would write, is copied (copy-on-write: the runner copies
        it before the next forward pass). With no block free for the copy, the child recomputes it."""
        request = parent.request
        child = self._new_sequence(request, choice, list(parent.prompt_token_ids))
        bm = self.block_manager
        shared = parent.num_computed_tokens // bm.block_size
        bm.share(parent, child, shared)
        child.num_computed_tokens = shared * bm.block_size
        if child.num_computed_tokens < parent.num_computed_tokens:
            dst = bm.allocate_one(child)
            if dst is not None:
                self._pending_copies.append((child, parent.block_table[shared], dst))
                child.num_computed_tokens = parent.num_computed_tokens
        request.seqs.append(child)
        self.scheduler.add_running(child)
        return child

    def _append_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None, now: float) -> None:
        metrics = seq.request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        seq.token_ids.append(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        self.stop_checker.append_text(seq, seq.detokenizer.add([token]))
        self.stop_checker.check_token(seq, token)
        if seq.finish_reason is None:
            return
        if seq.stop_reason is None or isinstance(seq.stop_reason, int):
            self.stop_checker.append_text(seq, seq.detokenizer.flush())
        self.scheduler.remove(seq)

    def _finish_if_done(self, request: Request) -> RequestOutput | None:
        """The request's output after a step, if it finished or asked for every step's."""
        if request.is_finished:
            request.metrics.finished_time = time.monotonic()
            self.requests.pop(request.request_id, None)
        elif request.params.output_kind is RequestOutputKind.FINAL_ONLY:
            return None
        return self._request_output(request)

    def _request_output(self, request: Request) -> RequestOutput:
        """A snapshot: nothing in it changes as the engine goes on, so other threads may keep it."""
        seqs = request.seqs if len(request.seqs) == 1 else sorted(request.seqs, key=lambda s: s.index)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion_output(s) for s in seqs],
            finished=request.is_finished,
            metrics=copy.copy(request.metrics),
            num_cached_tokens=request.num_cached_tokens or 0,
        )

    # ---- introspection --------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_unfinished_requests=len(self.requests),
            num_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            num_used_blocks=bm.num_used_blocks,
            kv_cache_usage=bm.usage,
            num_preemptions=self.scheduler.num_preemptions,
            num_cached_blocks=bm.num_cached_blocks,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            num_steps=self.num_steps,
            num_pending_prefill_tokens=self._pending_prefill_tokens(),
        )

    def _pending_prefill_tokens(self) -> int:
        sched = self.scheduler
        waiting = sum(s.num_uncomputed_tokens for s in sched.waiting)
        return waiting + sum(s.num_uncomputed_tokens for s in sched.running if s.num_uncomputed_tokens > 1)

    def live_sequences(self) -> list[Sequence]:
        return [s for r in self.requests.values() for s in r.seqs if s.status is not SequenceStatus.FINISHED]

    def check_invariants(self) -> None:
        """Block accounting is exact: every block is free or owned, ref counts equal owners."""
        self.block_manager.check_invariants(self.live_sequences())


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        logger.warning("ignoring unreadable %s", path)
        return {}

