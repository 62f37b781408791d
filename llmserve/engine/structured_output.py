"""The engine core's structured output: grammars compiled off the step loop and cached by spec, and
each step's token bitmask.

A request with a grammar waits in the core (not in the scheduler) until its grammar is compiled on
a worker thread (xgrammar releases the interpreter lock while it compiles), so the requests already
running keep stepping; it is queued for scheduling once the grammar is ready, or finished with an
error if it does not compile. Compiled grammars are kept in an LRU keyed by `GrammarSpec`; a request
whose spec is cached is queued at once. A compile that completes writes a byte to a pipe, so a core
with nothing else to do can sleep on that pipe (and its input socket) instead of polling.

Every sequence follows its grammar with its own `GrammarState` (the scheduler advances it as tokens
are appended); `fill_bitmask` packs the allowed tokens of each constrained sampling row for the
sampler.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from llmserve.engine.grammar import GrammarCompiler, GrammarSpec, GrammarState, tokenizer_info
from llmserve.engine.wakeup import Wakeup

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

CACHE_SIZE = 512  # compiled grammars kept (a JSON schema's is tens to hundreds of KB)


class StructuredOutputManager:
    def __init__(self, tokenizer_dir: Path, vocab_size: int, eos_token_ids: frozenset[int],
                 cache_size: int = CACHE_SIZE) -> None:
        self._tokenizer_json = Path(tokenizer_dir) / "tokenizer.json"
        self.vocab_size = vocab_size
        self._eos_token_ids = eos_token_ids
        self._cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self.wakeup = Wakeup()  # readable after a compile completed
        self.bitmask_width = (vocab_size + 31) // 32

    # ---- compiling -------------------------------------------------------------------------------
    def compile(self, spec: GrammarSpec) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of `spec`, from the cache or compiling on the worker thread."""
        future = self._cache.get(spec)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(spec)
            return future  # a failed compile is not kept: the next request with it tries again
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmserve-grammar")
        future = self._pool.submit(self._compile, spec)
        self._cache[spec] = future
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        future.add_done_callback(self._on_done)
        return future

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        return self._get_compiler().compile(spec)

    def _get_compiler(self) -> GrammarCompiler:
        """Built on first use (reading the vocabulary takes a while), on the worker thread."""
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(
                    tokenizer_info(self._tokenizer_json, self.vocab_size, self._eos_token_ids)
                )
            return self._compiler

    def _on_done(self, future: Future) -> None:
        self.wakeup.notify()

    # ---- per step --------------------------------------------------------------------------------
    def new_bitmask(self, rows: int) -> np.ndarray:
        return np.empty((rows, self.bitmask_width), dtype=np.int32)

    @staticmethod
    def new_state(compiled: xgr.CompiledGrammar, start_after: list[int]) -> GrammarState:
        return GrammarState(compiled, start_after)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self.wakeup.close()
