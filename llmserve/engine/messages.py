"""What crosses the boundary between the front end and the engine core: small typed structs,
encoded with msgspec's MessagePack (no pickling of objects with behaviour).

In: requests (token ids and sampling parameters), aborts, utility calls, shutdown.
Out: one `EngineCoreOutputs` per engine step, carrying the new token of every sequence that got one,
the step's record and the core's stats; answers to utility calls; a last word if the core dies.
"""

from __future__ import annotations

from typing import Any

import msgspec

from llmserve.model.lora_request import LoRARequest
from llmserve.model.pooling import PoolingParams
from llmserve.multimodal.inputs import ImageInput
from llmserve.sampling.params import SamplingParams


class SpecDecodeStats(msgspec.Struct, array_like=True, gc=False):
    """Speculative decoding since the core started (vLLM's spec_decode counters)."""

    num_drafts: int = 0  # drafts verified
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = []  # how often the draft's k-th token was accepted


class KVTransferParams(msgspec.Struct, omit_defaults=True, gc=False):
    """Prefill/decode disaggregation (`kv_transfer`), as vLLM's `kv_transfer_params` name it.

    On a request: `do_remote_decode` (compute the prompt and keep its KV for another engine to pull) or
    `do_remote_prefill` with where to pull it from (`remote_host`, `remote_port`, `transfer_id`). On the
    last output of a `do_remote_decode` request: the transfer's id, port and tokens."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    transfer_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    num_tokens: int | None = None  # the prompt tokens whose KV is held


class EngineStats(msgspec.Struct, array_like=True, gc=False):
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
    num_requests_added: int = 0  # requests the core has taken in since it started
    running_loras: list[str] = []  # with LoRA served: the adapters of the running requests, by name
    waiting_loras: list[str] = []  # and of the waiting ones
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding: its counts so far
    # Priority policy: (priority, waiting sequences, their tokens still to prefill) per priority, lowest first.
    waiting_by_priority: list[tuple[int, int, int]] = []
    # KV transfer (disaggregation) since the core started: blocks sent and received, pulls that failed
    # (the request computed its prompt itself), held exports nobody pulled in time, and blocks held now.
    kv_blocks_sent: int = 0
    kv_blocks_received: int = 0
    kv_pulls_failed: int = 0
    kv_exports_expired: int = 0
    kv_blocks_held: int = 0
    # The prefix cache's second tier: blocks saved there and loaded back since the start, and what it holds now.
    kv_offload_saved: int = 0
    kv_offload_loaded: int = 0
    kv_offload_blocks: int = 0
    kv_offload_bytes: int = 0


class StepRecord(msgspec.Struct, array_like=True, frozen=True, gc=False):
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


# ---- in ------------------------------------------------------------------------------------------


class EngineCoreRequest(msgspec.Struct, tag=True, array_like=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    priority: int = 0
    cache_salt: str | None = None
    pooling: PoolingParams | None = None  # an embedding request: its prompt's pooled hidden states, no tokens
    lora: LoRARequest | None = None  # the LoRA adapter it generates with
    kv_transfer: KVTransferParams | None = None  # disaggregation: export its prompt's KV, or import it
    images: list[ImageInput] = []  # a vision-language model's: the images its placeholder tokens stand for


class AbortRequests(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Drop these requests (their client is gone) and free their KV."""

    request_ids: list[str]


class StopChoices(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Finish these choices (request id, choice index): a stop string ended them in the front end."""

    choices: list[tuple[str, int]]


class UtilityCall(msgspec.Struct, tag=True, array_like=True, gc=False):
    """Run `EngineCore.<method>(*args)` between steps and answer with a `UtilityResult`."""

    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag=True, array_like=True, gc=False):
    pass


EngineCoreInput = EngineCoreRequest | AbortRequests | StopChoices | UtilityCall | Shutdown


# ---- out -----------------------------------------------------------------------------------------


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One new token of one sequence (choice `index` of request `request_id`)."""

    request_id: str
    token_id: int
    index: int = 0
    # "stop" | "length": the core ended it on this token; "error" with token_id -1: it ended without
    # one (its grammar failed to compile in the core)
    finish_reason: str | None = None
    stop_reason: int | None = None  # the stop token id that ended it
    logprob: float | None = None  # of the token, when the request asked for logprobs
    rank: int | None = None  # of the token among the raw logits (1 = the most likely), with its logprob
    top_ids: list[int] | None = None  # the top logprobs, as many as asked for
    top_logprobs: list[float] | None = None
    scheduled_time: float | None = None  # on the request's first output: when it was first scheduled
    num_cached_tokens: int | None = None  # on the first output: prompt tokens found in the prefix cache
    num_preemptions: int = 0  # on the last output
    embedding: bytes | None = None  # an embedding request's one output (token_id -1): float32 values
    kv_transfer: KVTransferParams | None = None  # on the last output of a request exporting its KV: where it is
    # on each output of a request with a predicted output: the drafts its choice had verified so far, and those taken
    num_draft_tokens: int = 0
    num_accepted_drafts: int = 0


class PromptLogprobsChunk(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of consecutive prompt tokens of request `request_id`, from token `start` on (>= 1: the
    first prompt token has none); a step scores the prompt positions it computes."""

    request_id: str
    start: int
    logprobs: list[float]
    ranks: list[int]  # among the raw logits, 1 = the most likely
    top_ids: list[list[int]]  # per token, as many as the request asked for
    top_logprobs: list[list[float]]


class EngineCoreOutputs(msgspec.Struct, tag=True, array_like=True, gc=False):
    outputs: list[EngineCoreOutput]
    step: StepRecord | None = None
    stats: EngineStats | None = None
    # Sent before `outputs` are applied: a request's first token comes with its whole prompt's logprobs.
    prompt_logprobs: list[PromptLogprobsChunk] = []


class UtilityResult(msgspec.Struct, tag=True, array_like=True, gc=False):
    call_id: int
    result: Any = None
    error: str | None = None  # the exception's repr when the call raised


class EngineCoreReady(msgspec.Struct, tag=True, array_like=True, gc=False):
    """The core loaded its model and takes requests."""

    pid: int
    num_blocks: int


class EngineCoreDead(msgspec.Struct, tag=True, array_like=True, gc=False):
    """The core's last message: it failed (to start, or in a step) and is exiting."""

    error: str


EngineCoreMessage = EngineCoreOutputs | UtilityResult | EngineCoreReady | EngineCoreDead


def input_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineCoreInput)


def output_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineCoreMessage)
