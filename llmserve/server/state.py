"""What every endpoint shares: the served models (one engine each, found by name or alias), admission
control, and the platform services (keys, limits, metering, conversations, safety) when they are on."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from llmserve.engine.async_llm import AsyncLLM
from llmserve.heap import freeze_startup_heap
from llmserve.model.lora_request import LoRARequest
from llmserve.platform.content_routing import ContentRouter
from llmserve.platform.routing import LoadState, ModelFailed, ModelLoading, ModelRouter
from llmserve.platform.safety import OutputGuard
from llmserve.server import errors
from llmserve.server.limits import PromptBound
from llmserve.server.logprobs import TokenTexts
from llmserve.server.protocol import now
from llmserve.server.reasoning import ReasoningParser, reasoning_parser
from llmserve.server.streaming import StreamRegistry
from llmserve.server.tool_calls import ToolParser, tool_parser_for
from llmserve.server.workers import WorkerPool
from llmserve.tokenizer.continuations import ContinuationCache

if TYPE_CHECKING:
    from llmserve.platform.keys import ApiKey
    from llmserve.server.gateway import Platform
    from llmserve.server.metrics import ServerMetrics, Telemetry


@dataclass
class ModelEndpoint:
    """One served model: its engine and what the endpoints need to know about it."""

    name: str
    engine: AsyncLLM
    root: str | None = None  # where the weights came from (shown in /v1/models)
    max_waiting_requests: int = 1024
    telemetry: Telemetry | None = None
    created: int = field(default_factory=now)
    tool_call_parser: str | None = None  # a --tool-call-parser name; None: the model family's format
    reasoning_parser: str | None = None  # a --reasoning-parser name; None: replies have no reasoning part
    lora: LoRARequest | None = None  # a LoRA adapter served under its own name: what it generates with
    parent: str | None = None  # an adapter's base model
    token_texts: TokenTexts = field(init=False)
    continuations: ContinuationCache = field(init=False)
    prompt_bound: PromptBound = field(init=False)
    tool_parser: ToolParser | None = field(init=False)  # the format tool_choice "auto" parses replies in
    reasoning: ReasoningParser | None = field(init=False)
    reasoning_end_ids: list[int] = field(init=False)  # where structured output starts after the reasoning
    reasoning_start_ids: list[int] = field(init=False)  # where a thinking budget starts counting

    def __post_init__(self) -> None:
        tokenizer = self.engine.tokenizer
        self.token_texts = TokenTexts(tokenizer)
        self.continuations = ContinuationCache(tokenizer)
        self.prompt_bound = PromptBound(tokenizer, self.engine.max_model_len)
        self.tool_parser = tool_parser_for(
            self.tool_call_parser, tokenizer.chat_template, self.engine.model_config.architecture
        )
        self.reasoning = reasoning_parser(self.reasoning_parser) if self.reasoning_parser else None
        self.reasoning_end_ids = self.reasoning.end_token_ids(tokenizer) if self.reasoning is not None else []
        self.reasoning_start_ids = self.reasoning.start_token_ids(tokenizer) if self.reasoning is not None else []

    def adapter(self, lora: LoRARequest) -> ModelEndpoint:
        """This model's endpoint for one of its LoRA adapters: the same engine and caches, its own name."""
        served = copy.copy(self)
        served.name, served.lora, served.parent, served.root = lora.lora_name, lora, self.name, lora.lora_path
        served.created = now()
        return served

    def check_generates(self, what: str) -> None:
        """A 400 when this is a LoRA adapter: adapters generate (chat, completions, responses), nothing else."""
        if self.lora is not None:
            raise errors.APIError(
                400, f"The model {self.name!r} is a LoRA adapter of {self.parent!r}: adapters serve chat and "
                f"completions, not {what}.", param="model", code="invalid_value",
            )

    def admit(self, prompts: Sequence[str | Sequence[int]] = ("",), draining: bool = False, priority: int = 0) -> None:
        """Admission control: refuse with 503 when draining, when the waiting queue is full, or when
        the TTFT target (--slo-ttft-ms) cannot be met at the current load. Under the priority policy
        only what would run before a request of `priority` counts: later ones it overtakes."""
        if draining or not self.engine.is_accepting:
            if self.engine.dead_error is not None:
                raise errors.from_exception(self.engine.dead_error)
            raise errors.shutting_down()
        waiting, queued_tokens = self.engine.queue_ahead(priority)
        if waiting + len(prompts) > self.max_waiting_requests:
            self._reject("queue_full")
            raise errors.overloaded(
                f"The server has {waiting} requests waiting (limit {self.max_waiting_requests}); retry later."
            )
        self._check_ttft_slo(prompts, queued_tokens)

    def _check_ttft_slo(self, prompts: Sequence[str | Sequence[int]], queued: int) -> None:
        telemetry = self.telemetry
        if telemetry is None or telemetry.slo.ttft_ms is None:
            return
        telemetry.drain()
        prompt_tokens = sum(self.num_tokens(p) for p in prompts)
        predicted = telemetry.estimator.predict_ttft(queued, prompt_tokens)
        target = telemetry.slo.ttft_ms / 1000
        if predicted is None or predicted <= target:
            return
        self._reject("slo_ttft")
        raise errors.overloaded(
            f"The server cannot meet its time-to-first-token target of {telemetry.slo.ttft_ms:g} ms now "
            f"(estimated {predicted * 1000:.0f} ms); retry later.",
            retry_after=telemetry.estimator.retry_after(predicted, target),
        )

    def num_tokens(self, prompt: str | Sequence[int]) -> int:
        return len(self.engine.tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)

    def _reject(self, reason: str) -> None:
        if self.telemetry is not None:
            self.telemetry.reject(reason)


@dataclass
class ServerState:
    router: ModelRouter[ModelEndpoint]
    metrics: ServerMetrics
    platform: Platform | None = None  # None: no keys, limits, metering or conversations
    draining: bool = False  # set on SIGTERM: new requests get a 503
    workers: WorkerPool = field(default_factory=WorkerPool)  # tokenization, templating, the safety screen
    streams: StreamRegistry = field(default_factory=StreamRegistry)  # resumable streams, by response id
    content_routers: dict[str, ContentRouter] = field(default_factory=dict)  # model names routed by the request's text
    allowed_media_domains: frozenset[str] = frozenset()  # the hosts image URLs are fetched from (empty: any)
    trust_request_chat_template: bool = False  # a chat request may bring its own chat template
    created: int = field(default_factory=now)
    _tasks: set[asyncio.Task] = field(default_factory=set)
    _ready: asyncio.Event | None = None

    def background(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run `work` on the event loop, holding on to the task until it ends."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _ready_event(self) -> asyncio.Event:
        if self._ready is None:
            self._ready = asyncio.Event()
        return self._ready

    def model_settled(self) -> None:
        """A model finished loading (or failed to): wake whoever waits for them all."""
        if not self.router.loading_names():
            freeze_startup_heap()
            self._ready_event().set()

    async def wait_ready(self) -> None:
        """Return once no model is loading any more (ready or failed)."""
        if self.router.loading_names():
            await self._ready_event().wait()

    def endpoint(
        self, model: str | None, key: ApiKey | None = None, routing_key: str | None = None
    ) -> ModelEndpoint:
        """The endpoint a request for `model` goes to: by name or alias (a canary alias picks a version,
        the same one for the same `routing_key`). Unset means the first model. 404 for an unknown model
        or one the key may not use; 503 with Retry-After while it loads."""
        name = model if model is not None else self.router.default_name()
        if key is not None and not key.allows_model(name):
            raise errors.model_not_found(name)
        return self._resolved(name, routing_key)

    async def routed_endpoint(
        self, model: str | None, key: ApiKey | None, routing_key: str | None, texts: Callable[[], Sequence[str]]
    ) -> ModelEndpoint:
        """`endpoint`, where `model` may also name a content router: the key needs the router's name, and the
        request goes where the router sends it by `texts()` (to its default when that model is not ready)."""
        router = self.content_routers.get(model) if model is not None else None
        if router is None:
            return self.endpoint(model, key, routing_key)
        if key is not None and not key.allows_model(router.name):
            raise errors.model_not_found(router.name)
        choice = await router.choose(texts())
        chosen, reason = choice.model, choice.reason
        if chosen != router.config.default and self.router.state(chosen) is not LoadState.READY:
            chosen, reason = router.config.default, "unavailable"
        self.metrics.platform.routed.labels(router.name, chosen, reason).inc()
        return self._resolved(chosen, routing_key)

    def _resolved(self, name: str, routing_key: str | None) -> ModelEndpoint:
        try:
            _, endpoint = self.router.resolve(name, routing_key)
        except KeyError:
            raise errors.model_not_found(name) from None
        except ModelLoading as exc:
            raise errors.model_loading(name, exc.retry_after_s) from None
        except ModelFailed as exc:
            raise errors.APIError(503, str(exc), code="model_failed") from None
        return endpoint

    def endpoints(self) -> list[ModelEndpoint]:
        """Every model that is ready, in the order they were given (not their LoRA adapters)."""
        return base_endpoints(self.router)

    @property
    def default(self) -> ModelEndpoint:
        return self.endpoint(None)

    @property
    def screens_outputs(self) -> bool:
        return self.output_guard() is not None

    def output_guard(self) -> OutputGuard | None:
        """A fresh streaming post-filter for one choice, when a safety filter is on."""
        if self.platform is None or self.platform.safety is None:
            return None
        return OutputGuard(self.platform.safety, self.platform.holdback_chars)


def base_endpoints(router: ModelRouter[ModelEndpoint]) -> list[ModelEndpoint]:
    """The ready models' endpoints, one per engine (an adapter's shares its model's)."""
    return [endpoint for endpoint in router.ready_handles() if endpoint.lora is None]


def get_state(request: Request) -> ServerState:
    return request.app.state.llmserve
