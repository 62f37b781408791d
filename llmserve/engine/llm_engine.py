"""The in-process engine for offline use: the input processor, an `EngineCore` in this process and
the output processor, driven by `step()`. Requests in, `RequestOutput`s out; no HTTP, no threads
(but the core's own step worker when it overlaps steps on a CPU).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq

from llmserve.config import EngineConfig
from llmserve.engine.core import EngineCore
from llmserve.engine.input_processor import InputProcessor
from llmserve.engine.messages import EngineStats, KVTransferParams
from llmserve.engine.model_facts import load_model
from llmserve.engine.output_processor import OutputProcessor
from llmserve.errors import InvalidRequestError
from llmserve.model.lora_request import LoRARequest
from llmserve.model.pooling import PoolingParams
from llmserve.outputs import EmbeddingRequestOutput, RequestOutput
from llmserve.sampling.params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.facts, self.tokenizer = load_model(config)
        self.config = config = self.facts.settled(config)
        self.input_processor = InputProcessor(config, self.facts, self.tokenizer)
        self.core = EngineCore(config, self.facts)
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_args(cls, model: str, **kwargs) -> LLMEngine:
        return cls(EngineConfig(model=model, **kwargs))

    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len

    def default_sampling_params(self) -> SamplingParams:
        return self.input_processor.default_sampling_params()

    # ---- requests -------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        kv_transfer: KVTransferParams | None = None,
    ) -> None:
        """Validate and queue a request. Raises InvalidRequestError; nothing is queued then."""
        if request_id in self.output_processor.requests:
            raise InvalidRequestError(f"Request id {request_id!r} is already in use.", param="request_id")
        request = self.input_processor.process(
            request_id, prompt, params, priority, cache_salt, lora_request, kv_transfer
        )
        self.output_processor.add_request(request, prompt, arrival_time if arrival_time is not None else time.monotonic())
        self.core.add_request(request)

    def add_embedding_request(
        self,
        request_id: str,
        prompt: str | Seq[int],
        pooling: PoolingParams | None = None,
        truncate_prompt_tokens: int | None = None,
        priority: int = 0,
    ) -> None:
        """Validate and queue an embedding request (its one output is an `EmbeddingRequestOutput`)."""
        if request_id in self.output_processor.requests:
            raise InvalidRequestError(f"Request id {request_id!r} is already in use.", param="request_id")
        request = self.input_processor.process_embedding(request_id, prompt, pooling, truncate_prompt_tokens, priority)
        self.output_processor.add_request(request, prompt, time.monotonic())
        self.core.add_request(request)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Stop requests wherever they are; their blocks return to the pool at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = [output for r in ids if (output := self.output_processor.abort(r)) is not None]
        self.core.abort_requests(ids)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """Run one engine step; report every request that made progress in the step that completed.
        When the only requests left wait for their grammar or their prompt's KV, it first waits for one."""
        if not self.core.can_step():
            self.core.wait_for_pending()
        core_outputs = self.core.step()
        if core_outputs is None:
            return []
        processed = self.output_processor.process(core_outputs.outputs, core_outputs.prompt_logprobs)
        if processed.stopped:
            self.core.stop_choices(processed.stopped)
        return processed.outputs

    # ---- introspection --------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return self.core.stats()

    def check_invariants(self) -> None:
        self.core.check_invariants()
