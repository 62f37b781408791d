"""The model runner: owns the weights and the KV cache tensors, turns a `StepBatch` (plain arrays:
tokens, block tables, rows to sample and how) into one forward pass over its flattened tokens, and
samples the next tokens.

On CPU, steps of a few bf16 tokens (batch-1 decode) run the whole forward pass in one C call
(`cpu_decode`) when the model and its settings allow; others take the model's own forward pass.

On CUDA it also sizes the KV pool from a profiling step, replays CUDA graphs for decode-only steps
(`cuda_graphs`), and keeps the step free of host syncs: every input tensor is built on the host and
sent before the forward pass is launched, and the sampled ids are copied back asynchronously, so
`execute` returns while the device still works and `StepHandle.result()` is the one wait.

The sampled ids also stay on the device for the next step: a token the host has not seen yet (the
engine schedules step N+1 before step N's tokens reach it) is named in the batch as a pending token
and filled in on the device from the previous step's samples.
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import numpy as np
import torch

from llmserve.config import DEFAULT_STEP_TOKENS, EngineConfig
from llmserve.errors import ModelLoadError
from llmserve.model import cpu_linear, huge_pages, parallel
from llmserve.model.attention import AttentionBackend, AttentionMetadata, get_backend
from llmserve.model.config import ModelConfig, parse_dtype
from llmserve.model.cpu_decode import CpuDecoder
from llmserve.model.cuda_graphs import (
    GRAPH_SAFE_BACKENDS,
    CudaGraphCapture,
    DecodeGraphs,
    GraphCapture,
    graph_batch_sizes,
    make_model_forward,
)
from llmserve.model.dummy_weights import init_dummy_weights_
from llmserve.model.layers import MRotaryEmbedding
from llmserve.model.loader import iterate_weights
from llmserve.model.lora import LoRASlots, supports_lora
from llmserve.model.memory import MemoryProfile, kv_cache_budget, num_kv_blocks, profile_prompt_lengths
from llmserve.model.pooling import PoolerConfig, pool, truncate_embedding
from llmserve.model.quantization import QuantizedLoader, resolve_quantization
from llmserve.model.registry import model_class
from llmserve.sampling.params import SamplingParams
from llmserve.sampling.sampler import Sampler, SamplerOutput, SamplingMetadata, SamplingRow, to_device

logger = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]

# The profiling step samples with the most expensive settings (full-vocabulary sort, top logprobs).
_PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_p=0.95, logprobs=20)
# Prompt logprobs take the logits of this many positions at a time, which bounds their memory.
PROMPT_LOGITS_SLICE = 512
MAX_PROMPT_LOGPROBS = 20


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(requested: str, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """An explicit dtype wins; "auto" is the checkpoint's dtype on CPU, and on CUDA bfloat16 unless the
    checkpoint is float16 (float32 checkpoints run in bfloat16 there, as they do in vLLM)."""
    if requested != "auto":
        return parse_dtype(requested)
    if device.type == "cuda":
        return torch.float16 if checkpoint_dtype == torch.float16 else torch.bfloat16
    return checkpoint_dtype


def resolve_kv_cache_dtype(requested: str, model_dtype: torch.dtype) -> torch.dtype:
    """"auto": the model dtype; "fp8" / "fp8_e4m3": float8 e4m3 (triton backend); "int8": int8 rows with a
    scale each (torch backend, CPU)."""
    if requested == "auto":
        return model_dtype
    if requested in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    if requested == "int8":
        return torch.int8
    raise ValueError(f"kv_cache_dtype must be auto, fp8, fp8_e4m3 or int8, got {requested!r}.")


def choose_attention_backend(requested: str | None, device: torch.device) -> type[AttentionBackend]:
    """The named backend; unnamed, "triton" on CUDA (or "torch" with a warning when it is unavailable)
    and "torch" elsewhere."""
    if requested is not None:
        return get_backend(requested)
    name = "triton" if device.type == "cuda" else "torch"
    try:
        return get_backend(name)
    except (ValueError, ImportError) as exc:
        logger.warning("attention backend %r is unavailable (%s); falling back to 'torch'", name, exc)
        return get_backend("torch")


@dataclass
class PromptLogprobsBatch:
    """Prompt positions whose following prompt token the step scores (SamplingParams.prompt_logprobs)."""

    token_index: np.ndarray  # [P] int64: each position's place among the step's flattened tokens
    target_ids: np.ndarray  # [P] int64: the prompt token that follows it
    num_top: int  # top logprobs per position: the most any of their requests asks for


@dataclass
class ImageSlice:
    """The part of an image whose placeholder tokens a step computes: its features `image_start` to
    `image_start + count` go to the step's tokens from `batch_start`."""

    digest: bytes
    pixels: np.ndarray  # float32, the whole image's as prepared: [3, height, width] or [views, 3, height, width]
    size: tuple[int, int]  # (height, width) as it came
    batch_start: int
    image_start: int
    count: int
    length: int  # the image's placeholder tokens in all

    @property
    def is_last(self) -> bool:
        """The step computes the image's last placeholders: its features are needed no more."""
        return self.image_start + self.count == self.length


@dataclass
class StepBatch:
    """One step's work in plain data, built by the engine core. Rows are sequences, decodes (one new
    token) first; tokens are flattened row after row."""

    input_ids: np.ndarray  # [T] int64: the new tokens of every row; a pending token's place holds 0
    num_computed: np.ndarray  # [S] int64: tokens of each row already in the KV cache (its first position)
    num_new: np.ndarray  # [S] int64: tokens each row computes this step
    block_tables: list[list[int]]  # [S] the KV blocks of each row, covering its tokens after the step
    logits_rows: list[int]  # one per token to sample: the row whose last new token gives the logits
    sampling_rows: list[SamplingRow]  # how to sample each of them
    # Tokens sampled by the previous step that the host does not know yet: input_ids[pending_index[i]]
    # is the previous step's sample number pending_source[i].
    pending_index: np.ndarray | None = None
    pending_source: np.ndarray | None = None
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copied first
    prompt_logprobs: PromptLogprobsBatch | None = None
    # Structured output: the sampling rows with a grammar, and their allowed tokens as packed bits
    # ([G, ceil(vocab / 32)] int32; bit j of word w allows token 32 * w + j).
    mask_rows: np.ndarray | None = None
    token_bitmask: np.ndarray | None = None
    # Embeddings: the rows (each a whole sequence) whose hidden states are pooled, the dimensions each
    # one's embedding is cut to (None: all), and where a text pair's second text starts (token type 1 from
    # there; None: one text).
    pool_rows: list[int] = field(default_factory=list)
    pool_dimensions: list[int | None] = field(default_factory=list)
    pool_second_texts: list[int | None] = field(default_factory=list)
    lora_ids: list[int] = field(default_factory=list)  # with LoRA served: each row's adapter id (0: none)
    images: list[ImageSlice] = field(default_factory=list)  # a vision-language model's image placeholders
    # [T] int64: how far each token's position lags its index (images moved it on by their M-RoPE grids); None: not.
    position_shifts: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return len(self.num_new)


@dataclass
class ModelOutput:
    """What a step sampled, on the host: one entry per sampling row."""

    token_ids: list[int]
    logprobs: list[float] | None = None  # of each sampled token
    top_logprob_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    ranks: list[int] | None = None  # of each sampled token, when logprobs were asked
    prompt_logprobs: PromptLogprobsOutput | None = None
    embeddings: list[np.ndarray] = field(default_factory=list)  # float32, one per pooled row, in order


@dataclass
class PromptLogprobsOutput:
    """Per position of the batch's `PromptLogprobsBatch`: the next prompt token's logprob and rank
    among the raw logits, and the top `num_top` (ids, logprobs)."""

    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class StepTensors:
    """What a step leaves on the device: its samples and its prompt logprobs (when asked)."""

    sampled: SamplerOutput | None
    prompt: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # as PromptLogprobsOutput
    # [pooled rows, hidden] float32, normalised when the model is; a classifier's: [pooled rows, labels] logits
    pooled: torch.Tensor | None = None
    pool_dimensions: list[int | None] = field(default_factory=list)


class StepHandle:
    """A launched step; `result()` waits for its samples and embeddings (the step's one device->host wait)."""

    def __init__(self, output: StepTensors, device: torch.device) -> None:
        self._event = None
        sampled = output.sampled
        tensors: list[torch.Tensor | None] = []
        if sampled is not None:
            tensors += [sampled.token_ids, sampled.logprobs, sampled.top_logprob_ids, sampled.top_logprobs,
                        sampled.ranks]
        self._num_sampled = len(tensors)
        if output.prompt is not None:
            tensors += output.prompt
        self._pool_dimensions = output.pool_dimensions
        pooled = output.pooled
        if device.type == "cuda" and (tensors or pooled is not None):
            self._host = [None if t is None else _pinned_copy(t) for t in tensors]
            self._pooled = None if pooled is None else _pinned_copy(pooled)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._pooled = tensors, pooled

    def result(self) -> ModelOutput | None:
        if not self._host and self._pooled is None:
            return None  # only partial prefill chunks ran: nothing was sampled
        if self._event is not None:
            self._event.synchronize()
        host = [None if t is None else t.tolist() for t in self._host]
        sampled, prompt = host[: self._num_sampled], host[self._num_sampled :]
        output = ModelOutput(*sampled) if sampled else ModelOutput([])
        if prompt:
            output.prompt_logprobs = PromptLogprobsOutput(*prompt)
        if self._pooled is not None:
            output.embeddings = [
                truncate_embedding(row, dims)
                for row, dims in zip(self._pooled.numpy(), self._pool_dimensions, strict=True)
            ]
        return output


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


@dataclass
class StepInputs:
    """Everything one step sends to the device, built before the forward pass is launched."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_index: torch.Tensor | None  # [R] rows of the hidden states to sample from
    sampling: SamplingMetadata | None
    prompt_index: torch.Tensor | None = None  # [P] rows of the hidden states to score prompt tokens with
    prompt_targets: torch.Tensor | None = None  # [P, 1] the prompt token each of them scores
    prompt_num_top: int = 0
    pool_rows: list[int] = field(default_factory=list)  # rows whose hidden states become embeddings
    pool_dimensions: list[int | None] = field(default_factory=list)
    token_type_ids: torch.Tensor | None = None  # [T] an encoder's, when a text pair is in the step
    images: list[ImageSlice] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, model_dir, max_model_len: int,
        pooler: PoolerConfig | None = None, shared_bytes_per_block: int = 0, defer_kv_cache: bool = False,
    ) -> None:
        """`shared_bytes_per_block`: what a block of another pool with as many blocks costs (a draft model's),
        so that both fit the KV memory. `defer_kv_cache`: no KV pool until `allocate_kv_cache` (a draft model's
        weights are loaded before the served model measures what memory is left)."""
        self.config = config
        self.model_config = model_config
        self.pooler = pooler  # how hidden states become embeddings; None: the model does not embed
        self.device = resolve_device(config.device)
        if self.device.type == "cpu" and config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        self.dtype = resolve_dtype(config.dtype, model_config.dtype, self.device)
        model_config.dtype = self.dtype
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.quantization = resolve_quantization(
            config.quantization, model_config.raw, config.load_format == "dummy", config.quantize_lm_head
        )
        self.model = self._load_model(model_dir, max_model_len)
        self._check_parallel()
        # on CPU, the weights on 2 MiB pages where the kernel has them (None elsewhere): see huge_pages
        self.weight_arena = huge_pages.move_parameters(self.model) if self.device.type == "cpu" else None
        self.is_encoder = getattr(self.model, "is_encoder", False)  # no KV cache, no sampling
        self.lora = self._lora_slots() if config.lora_enabled else None  # LoRA adapters' slots in the layers
        self.classifies = hasattr(self.model, "classify")  # pooled states -> label logits
        self.uses_token_types = getattr(self.model, "uses_token_types", False)  # BERT's: a pair's second text
        self.attn_backend = choose_attention_backend(config.attention_backend, self.device)(
            model_config.num_attention_heads // parallel.size(), parallel.shard_kv_heads(model_config.num_key_value_heads),
            model_config.head_dim, self.block_size, self.dtype, kv_cache_dtype=self.kv_cache_dtype,
        )  # this tensor-parallel rank's heads
        if config.speculative is not None:  # a draft's row reads the KV the rows before it write in the same step
            self.attn_backend.separate_kv_writes()
        self.sampler = Sampler()
        self.memory_profile: MemoryProfile | None = None
        self.image_features: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # by image digest (`_input_embeds`)
        self.cpu_decoder: CpuDecoder | None = None  # built once the KV cache exists; the profiling step runs without
        self.graphs: DecodeGraphs | None = None
        self._last_sampled: torch.Tensor | None = None  # the previous step's sampled ids, on the device
        self.num_blocks = 0
        self.kv_caches: KVCaches = []
        if not defer_kv_cache:
            self.allocate_kv_cache(self._decide_num_blocks(shared_bytes_per_block))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The KV pool, and what is built over it: the CPU's one-call decoder, CUDA graphs."""
        self.num_blocks = num_blocks
        self.kv_caches = [] if self.is_encoder else self._allocate_kv_cache(num_blocks)
        # small bf16 steps on CPU: the whole forward pass in one C call (None where it does not apply; its layers
        # have no all-reduce between them)
        self.cpu_decoder = None if self.is_encoder or parallel.size() > 1 else CpuDecoder.build(
            self.model, self.kv_caches, self.attn_backend)
        if self._use_cuda_graphs():
            self._capture_or_run_eagerly()

    def kv_bytes_per_block(self) -> int:
        return self.attn_backend.kv_bytes_per_token() * self.model_config.num_hidden_layers * self.block_size

    def fast_step_tokens(self) -> int | None:
        """The most tokens a step takes before its cost per token jumps: on CPU, the one-call decoder's limit
        (a larger step's linear layers leave our kernels for a GEMM); None where steps have no such edge."""
        return self.cpu_decoder.max_tokens() or None if self.cpu_decoder is not None else None

    def compute_bound_past_fast_step(self) -> bool:
        """Whether a step past `fast_step_tokens` costs in proportion to its tokens: on a CPU without bf16 GEMM
        instructions (AVX512-BF16, AMX) its GEMM runs in float32 (`cpu_linear.float32_gemm`)."""
        return self.fast_step_tokens() is not None and not cpu_linear.native_bf16_gemm()

    # ---- setup ----------------------------------------------------------------------------------
    def _check_parallel(self) -> None:
        """Tensor parallelism splits a generating decoder's layers (model/parallel.py)."""
        if parallel.size() == 1:
            return
        if getattr(self.model, "is_encoder", False) or hasattr(self.model, "classify"):
            raise ModelLoadError(f"Tensor parallelism serves generating decoders, not {self.model_config.architecture}.")

    def _load_model(self, model_dir, max_model_len: int) -> torch.nn.Module:
        cls = model_class(self.model_config.architecture)
        if (self.quantization is not None and getattr(cls, "has_experts", False)
                and "quantization_config" in self.model_config.raw):
            raise ModelLoadError(f"Quantized checkpoints of mixture-of-experts models ({cls.__name__}) are not read; "
                                 "serve the unquantized one, with --quantization int8 to quantize it at load.")
        with torch.device(self.device):
            model = cls(self.model_config, max_positions=max_model_len)
        if isinstance(getattr(model, "rotary", None), MRotaryEmbedding):  # a step's image tokens' rows
            model.rotary.reserve(self.config.max_num_batched_tokens or DEFAULT_STEP_TOKENS)
        quantized = QuantizedLoader(model, self.quantization) if self.quantization is not None else None
        if self.config.load_format == "dummy":
            init_dummy_weights_(model, self.config.seed)
            if quantized is not None:
                quantized.quantize_in_place()
        elif quantized is not None:  # by the names the quantizer knows the layers by (a LLaVA's are nested)
            rename = getattr(model, "rename_weights", None)
            quantized.load(rename(iterate_weights(model_dir)) if rename else iterate_weights(model_dir))
        else:
            model.load_weights(iterate_weights(model_dir))
        if quantized is not None:
            quantized.finalize(self.dtype)
        return model.eval()

    def _lora_slots(self) -> LoRASlots:
        if not supports_lora(self.model) or self.is_encoder or hasattr(self.model, "classify"):
            raise ModelLoadError(
                f"LoRA adapters are served on generating Llama-family decoders, not on {self.model_config.architecture}."
            )
        config = self.config
        return LoRASlots(self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras or config.max_loras,
                         self.dtype)

    def read_weights(self, model_dir: Path) -> list[tuple[str, torch.Tensor]]:
        """Another checkpoint's tensors, checked against this model (every parameter present, each shape
        the same) on a shadow model without storage, so the live one is untouched: safe on a thread
        while steps run. Raises ModelLoadError when they do not fit."""
        weights = list(iterate_weights(model_dir))
        with torch.device("meta"):
            shadow = model_class(self.model_config.architecture)(self.model_config, max_positions=self.max_model_len)
        shadow.load_weights(weights)
        return weights

    @torch.no_grad()
    def swap_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Copy weights `read_weights` checked into the live model, in place (between two steps: on a
        GPU the copies queue behind the step in flight, so it finishes on the old weights)."""
        self.model.load_weights(weights)

    def _decide_num_blocks(self, shared_bytes_per_block: int) -> int:
        if self.is_encoder:
            return 0
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = self.kv_bytes_per_block() + shared_bytes_per_block
        if self.device.type != "cuda":
            return max(1, self.config.kv_cache_memory // per_block)
        self.memory_profile = self.profile_memory()
        budget = kv_cache_budget(self.memory_profile, self.config.gpu_memory_utilization)
        blocks = parallel.all_min(num_kv_blocks(budget, per_block))  # what every tensor-parallel rank can hold
        logger.info(
            "KV cache: %.2f GiB for %d blocks (peak without KV %.2f GiB, outside torch %.2f GiB, device %.2f GiB)",
            blocks * per_block / (1 << 30), blocks, self.memory_profile.peak_torch_bytes / (1 << 30),
            self.memory_profile.non_torch_bytes / (1 << 30), self.memory_profile.total_bytes / (1 << 30),
        )
        return blocks

    def _allocate_kv_cache(self, num_blocks: int) -> KVCaches:
        shape = self.attn_backend.kv_cache_shape(num_blocks)
        # Zeros, not empty: padded block-table entries read block contents that the mask then ignores,
        # and uninitialised memory could hold NaNs that survive a zero attention weight. On CPU the zeros
        # are the kernel's zero pages, supplied as the cache is first written, rather than gigabytes of
        # memory written at start (2.6 s for the default 4 GiB).
        def zeros() -> torch.Tensor:
            if self.device.type == "cpu":
                return huge_pages.zero_mapped(shape, self.kv_cache_dtype)
            return torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)

        return [(zeros(), zeros()) for _ in range(self.model_config.num_hidden_layers)]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.kv_caches)

    # ---- memory profiling -----------------------------------------------------------------------
    def profile_memory(self) -> MemoryProfile:
        """Peak CUDA memory of the largest step, measured before the KV pool exists."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        scratch_bytes = self.run_profile_step()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch_bytes
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = max(0, (total - free) - torch.cuda.memory_reserved(self.device))
        torch.cuda.empty_cache()
        return MemoryProfile(total_bytes=total, peak_torch_bytes=peak, non_torch_bytes=non_torch)

    @torch.inference_mode()
    def run_profile_step(self) -> int:
        """One eager step at the engine's limits: prompts of max_num_batched_tokens tokens in all, then the
        sampler on max_num_seqs rows. It writes into a scratch KV cache just big enough, whose size in
        bytes it returns (it is part of the peak but not of what the engine needs besides its pool)."""
        budget = self.config.max_num_batched_tokens or DEFAULT_STEP_TOKENS  # an engine's config is settled already
        lengths = profile_prompt_lengths(budget, self.max_model_len)
        tables: list[list[int]] = []
        for length in lengths:
            first = sum(map(len, tables))
            tables.append(list(range(first, first + -(-length // self.block_size))))
        scratch = self._allocate_kv_cache(sum(map(len, tables)))
        scratch_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in scratch)
        num_rows = self.config.max_num_seqs
        batch = StepBatch(
            input_ids=np.zeros(sum(lengths), dtype=np.int64),
            num_computed=np.zeros(len(lengths), dtype=np.int64),
            num_new=np.array(lengths, dtype=np.int64),
            block_tables=tables,
            logits_rows=[i % len(lengths) for i in range(num_rows)],
            sampling_rows=[
                SamplingRow(_PROFILE_SAMPLING, seed=i, sample_index=0, prompt_token_ids=(), output_token_ids=())
                for i in range(num_rows)
            ],
        )
        batch.images = self._profile_images(sum(lengths))
        width = min(PROMPT_LOGITS_SLICE, sum(lengths))  # the largest slice of prompt logprobs, too
        batch.prompt_logprobs = PromptLogprobsBatch(
            np.arange(width, dtype=np.int64), np.zeros(width, dtype=np.int64), MAX_PROMPT_LOGPROBS
        )
        output = self._run(self.prepare_step(batch), scratch, use_graph=False).sampled
        assert output is not None
        output.token_ids.cpu()  # wait for the step, so its memory is all accounted
        del scratch
        self.image_features.clear()
        return scratch_bytes

    def _profile_images(self, num_tokens: int) -> list[ImageSlice]:
        """A vision-language model's profiling step reads as many images as its tokens hold (its vision tower's
        activations are part of the peak)."""
        if not hasattr(self.model, "embed_image"):
            return []
        pixels, size = self.model.largest_image(num_tokens)
        per_image = self.model.image_tokens(size)
        counts = [per_image] * (num_tokens // per_image) or [num_tokens]
        return [ImageSlice(i.to_bytes(16, "big"), pixels, size, i * per_image, 0, count, per_image)
                for i, count in enumerate(counts)]

    # ---- CUDA graphs ----------------------------------------------------------------------------
    def _use_cuda_graphs(self) -> bool:
        if self.device.type != "cuda" or self.config.enforce_eager or self.is_encoder:
            return False
        if parallel.size() > 1:  # not captured with the all-reduces inside yet
            return False
        if getattr(self.model, "has_experts", False):  # each step counts its experts' tokens on the host
            logger.info("CUDA graphs are off: a mixture of experts runs each step's chosen experts in turn")
            return False
        if self.attn_backend.name not in GRAPH_SAFE_BACKENDS:
            logger.warning("CUDA graphs are off: the %r attention backend is not graph-safe", self.attn_backend.name)
            return False
        return True

    def _capture_or_run_eagerly(self) -> None:
        try:
            self.capture_decode_graphs(CudaGraphCapture())
        except RuntimeError as exc:  # e.g. the backend syncs or copies from pageable memory during capture
            self.graphs = None
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            logger.warning("CUDA graph capture failed (%s); decode steps run eagerly", exc)

    @torch.inference_mode()
    def capture_decode_graphs(self, capture: GraphCapture) -> None:
        """Capture one decode step per batch size (CUDA graphs on CUDA; any `GraphCapture` in tests)."""
        sizes = graph_batch_sizes(self.config.max_num_seqs, self.config.cuda_graph_sizes)
        if not sizes:
            return
        forward = make_model_forward(self.model, self.kv_caches, self.attn_backend)
        self.graphs = DecodeGraphs(
            forward, self.attn_backend, sizes, self.max_model_len, self.block_size, self.device, capture
        )
        logger.info("captured decode graphs for batch sizes %s", sizes)

    # ---- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> StepHandle:
        """Copy the batch's blocks, run its forward pass (decodes lead) and sample one token per
        sampling row; returns without waiting for the device."""
        if batch.blocks_to_copy:
            self.copy_blocks(batch.blocks_to_copy)
        inputs = self.prepare_step(batch)
        if batch.pending_index is not None and len(batch.pending_index):
            self._fill_pending(inputs.input_ids, batch)
        output = self.run_step(inputs)
        self._last_sampled = output.sampled.token_ids if output.sampled is not None else None
        return StepHandle(output, self.device)

    def _fill_pending(self, input_ids: torch.Tensor, batch: StepBatch) -> None:
        """Put the previous step's samples, still on the device, where the batch names them."""
        if self._last_sampled is None:
            raise RuntimeError("the batch names pending tokens but the previous step sampled nothing")
        assert batch.pending_index is not None and batch.pending_source is not None
        index, source = self._to_device(batch.pending_index), self._to_device(batch.pending_source)
        input_ids.index_copy_(0, index, self._last_sampled.index_select(0, source))

    @torch.inference_mode()
    def run_step(self, inputs: StepInputs) -> StepTensors:
        """Launch the forward pass (a graph replay when one fits) and the sampler; no host sync."""
        return self._run(inputs, self.kv_caches, use_graph=self.graphs is not None)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The final hidden states of a step's tokens (`prepare_inputs`), computed as `execute` computes them."""
        return self._hidden_states(input_ids, positions, meta, self.kv_caches, use_graph=self.graphs is not None)

    def _hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: KVCaches,
        use_graph: bool, token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A CUDA graph's replay where one fits, else the one-call CPU decoder where it fits, else the model
        (which alone adds LoRA adapters)."""
        if token_type_ids is not None:
            return self.model(input_ids, positions, kv_caches, self.attn_backend, meta, token_type_ids)
        lora_slots = self.lora.token_slots if self.lora is not None else None
        if use_graph and lora_slots is None and self.graphs is not None and self.graphs.size_for(meta) is not None:
            return self.graphs.run(input_ids, positions, meta)
        if (self.cpu_decoder is not None and kv_caches is self.kv_caches and self.cpu_decoder.fits(len(input_ids))
                and (lora_slots is None or self.cpu_decoder.takes_lora())):
            return self.cpu_decoder(input_ids, positions, meta, lora_slots)
        self.attn_backend.prepare(meta)
        return self.model(input_ids, positions, kv_caches, self.attn_backend, meta)

    def _run(self, inputs: StepInputs, kv_caches: KVCaches, use_graph: bool) -> StepTensors:
        if inputs.images and hasattr(self.model, "embed_image"):  # (a text-only draft model reads placeholders)
            self.attn_backend.prepare(inputs.meta)
            embeds = self._input_embeds(inputs.input_ids, inputs.images)
            hidden = self.model(inputs.input_ids, inputs.positions, kv_caches, self.attn_backend, inputs.meta, embeds)
        else:
            hidden = self._hidden_states(inputs.input_ids, inputs.positions, inputs.meta, kv_caches, use_graph,
                                         inputs.token_type_ids)
        prompt = self._prompt_logprobs(hidden, inputs) if inputs.prompt_index is not None else None
        pooled = self._pool(hidden, inputs) if inputs.pool_rows else None
        if inputs.logits_index is None or inputs.sampling is None:
            # only partial prefill chunks (the KV cache was the point) and embeddings
            return StepTensors(None, prompt, pooled, inputs.pool_dimensions)
        logits = self.model.compute_logits(hidden[inputs.logits_index])
        return StepTensors(self.sampler(logits, inputs.sampling), prompt, pooled, inputs.pool_dimensions)

    def _input_embeds(self, input_ids: torch.Tensor, images: list[ImageSlice]) -> torch.Tensor:
        """The step's input embeddings: the image features in place of the placeholders it computes. An image's
        features are kept from the step that computes its first placeholders to the one that computes its last
        (a chunked prefill's), and computed again if they were dropped meanwhile."""
        features = self._image_features(images)
        embeds = self.model.embed_tokens(input_ids)
        for piece in images:
            rows = features[piece.digest][piece.image_start : piece.image_start + piece.count]
            embeds[piece.batch_start : piece.batch_start + piece.count] = rows.to(embeds.dtype)
        for piece in images:
            if piece.is_last:
                self.image_features.pop(piece.digest, None)
        return embeds

    def _image_features(self, images: list[ImageSlice]) -> dict[bytes, torch.Tensor]:
        needed = {piece.digest: piece for piece in images}
        missing = [piece for digest, piece in needed.items() if digest not in self.image_features]
        for piece in missing:
            pixels = torch.from_numpy(piece.pixels.copy()).to(self.device)
            self.image_features[piece.digest] = self.model.embed_image(pixels, piece.size)
        for digest in needed:
            self.image_features.move_to_end(digest)
        features = {digest: self.image_features[digest] for digest in needed}
        # Kept between a prefill's chunks: those of this step, and others up to a step's worth of rows in all (what the
        # memory profile's step held), the least recently used dropped first (a request that ended mid-image left
        # them; one preempted computes them again).
        kept = sum(rows.shape[0] for rows in self.image_features.values())
        budget = self.config.max_num_batched_tokens or DEFAULT_STEP_TOKENS
        for digest in [d for d in self.image_features if d not in needed]:
            if kept <= budget:
                break
            kept -= self.image_features.pop(digest).shape[0]
        return features

    def _pool(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """The embeddings of the pooled rows (whole sequences), normalised when the model is; a
        classifier's label logits."""
        if self.pooler is None:
            raise RuntimeError("the step pools hidden states, but the model has no pooler")
        pooled = pool(hidden, inputs.meta.query_start_loc_host, inputs.pool_rows, self.pooler.pooling)
        if self.classifies:
            return self.model.classify(pooled)
        return torch.nn.functional.normalize(pooled, dim=-1) if self.pooler.normalize else pooled

    def _prompt_logprobs(
        self, hidden: torch.Tensor, inputs: StepInputs
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each named position's float32 log_softmax at the next prompt token, that token's rank among
        the raw logits, and the top logprobs; a slice of positions at a time."""
        assert inputs.prompt_index is not None and inputs.prompt_targets is not None
        pieces = []
        for start in range(0, len(inputs.prompt_index), PROMPT_LOGITS_SLICE):
            index = inputs.prompt_index[start : start + PROMPT_LOGITS_SLICE]
            targets = inputs.prompt_targets[start : start + PROMPT_LOGITS_SLICE]
            logits = self.model.compute_logits(hidden[index]).float()
            logprobs = torch.log_softmax(logits, dim=-1)
            target_logits = logits.gather(1, targets)
            ranks = (logits > target_logits).sum(dim=1).add_(1)
            top_logprobs, top_ids = torch.topk(logprobs, inputs.prompt_num_top, dim=1)
            pieces.append((logprobs.gather(1, targets).squeeze(1), ranks, top_ids, top_logprobs))
        if len(pieces) == 1:
            return pieces[0]
        chosen, ranks, top_ids, top_logprobs = (torch.cat(parts) for parts in zip(*pieces, strict=True))
        return chosen, ranks, top_ids, top_logprobs

    # ---- KV transfer (disaggregation) ---------------------------------------------------------------
    @property
    def kv_layout(self) -> str:
        """What a block of this engine's KV is: another engine may only take blocks of the same layout."""
        block_shape = tuple(self.kv_caches[0][0].shape[1:]) if self.kv_caches else ()
        return (f"{self.model_config.architecture}/{self.model_config.num_hidden_layers} layers/block "
                f"{block_shape} {str(self.kv_cache_dtype).removeprefix('torch.')}")

    @property
    def num_kv_frames(self) -> int:
        """Frames `read_kv_blocks` gives: a key and a value cache per layer."""
        return 2 * len(self.kv_caches)

    def read_kv_blocks(self, block_ids: list[int]) -> list[memoryview]:
        """The bytes of these blocks, per layer its keys and then its values, on the host (for another engine)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        frames = []
        for key_cache, value_cache in self.kv_caches:
            for cache in (key_cache, value_cache):
                blocks = cache.index_select(0, index).cpu().contiguous()
                frames.append(memoryview(blocks.view(torch.uint8).reshape(-1).numpy()))
        return frames

    def check_kv_frames(self, block_ids: list[int], frames: Sequence[memoryview]) -> None:
        """ValueError unless each frame holds these blocks of one of this engine's caches."""
        block_bytes = self.kv_caches[0][0][0].numel() * self.kv_caches[0][0].element_size()
        if any(memoryview(frame).nbytes != len(block_ids) * block_bytes for frame in frames):
            raise ValueError(f"KV frames of other sizes than {len(block_ids)} blocks of {block_bytes} bytes")

    def write_kv_blocks(self, block_ids: list[int], frames: Sequence[memoryview]) -> None:
        """Put blocks read by another engine's `read_kv_blocks` into these blocks."""
        if len(frames) != 2 * len(self.kv_caches):
            raise ValueError(f"{len(frames)} KV frames for {len(self.kv_caches)} layers")
        self.check_kv_frames(block_ids, frames)
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        with warnings.catch_warnings():  # the frames are read-only, and only read
            warnings.simplefilter("ignore", UserWarning)
            for frame, cache in zip(frames, chain.from_iterable(self.kv_caches), strict=True):
                data = torch.frombuffer(frame, dtype=torch.uint8).view(cache.dtype).view(len(block_ids), *cache.shape[1:])
                cache.index_copy_(0, index, data.to(self.device))

    def copy_blocks(self, blocks_to_copy: Sequence[tuple[int, int]]) -> None:
        """Copy whole KV blocks, every layer's keys and values (block is the caches' first dimension)."""
        src = self._to_device(np.array([s for s, _ in blocks_to_copy], dtype=np.int64))
        dst = self._to_device(np.array([d for _, d in blocks_to_copy], dtype=np.int64))
        for key_cache, value_cache in self.kv_caches:
            key_cache[dst] = key_cache[src]
            value_cache[dst] = value_cache[src]

    # ---- inputs ---------------------------------------------------------------------------------
    def prepare_step(self, batch: StepBatch) -> StepInputs:
        """The step's device tensors: model inputs, the hidden-state rows to sample and the sampling
        metadata; all of it is sent before anything runs, so building it never waits on the device."""
        input_ids, positions, meta = self.prepare_inputs(batch)
        inputs = StepInputs(input_ids, positions, meta, None, None)
        if self.lora is not None:
            self.lora.activate(batch.lora_ids, batch.num_new, self.device)
        if batch.prompt_logprobs is not None:
            scored = batch.prompt_logprobs
            inputs.prompt_index = self._to_device(scored.token_index)
            inputs.prompt_targets = self._to_device(scored.target_ids.reshape(-1, 1))
            inputs.prompt_num_top = scored.num_top
        inputs.pool_rows, inputs.pool_dimensions = batch.pool_rows, batch.pool_dimensions
        inputs.images = batch.images
        if self.uses_token_types and any(start is not None for start in batch.pool_second_texts):
            inputs.token_type_ids = self._token_types(batch, meta.query_start_loc_host)
        if not batch.logits_rows:
            return inputs
        starts = meta.query_start_loc_host
        last_tokens = np.array([starts[row + 1] - 1 for row in batch.logits_rows], dtype=np.int64)
        inputs.logits_index = self._to_device(last_tokens)
        inputs.sampling = SamplingMetadata.build(batch.sampling_rows, self.model_config.vocab_size, self.device,
                                                 batch.mask_rows, batch.token_bitmask)
        return inputs

    def _token_types(self, batch: StepBatch, starts: list[int]) -> torch.Tensor:
        """1 from each text pair's second text to its end, 0 elsewhere (BERT's segment ids)."""
        types = np.zeros(starts[-1], dtype=np.int64)
        for row, second in zip(batch.pool_rows, batch.pool_second_texts, strict=True):
            if second is not None:
                types[starts[row] + second : starts[row + 1]] = 1
        return self._to_device(types)

    def prepare_inputs(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Positions and KV slots of every new token (numpy over the tokens, no Python loop per
        token), the attention metadata, and the device copies of it all."""
        num_new, begins = batch.num_new, batch.num_computed
        count = len(num_new)
        seq_lens = begins + num_new
        starts = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(num_new, out=starts[1:])
        total = int(starts[-1])
        if total == count:  # decodes only: one token each
            positions = begins
            rows = np.arange(count)
        else:
            rows = np.repeat(np.arange(count), num_new)
            positions = np.arange(total) - np.repeat(starts[:-1] - begins, num_new)
        block_tables = _padded_block_tables(batch.block_tables)
        bs = self.block_size
        if self.is_encoder:  # nothing is cached: no slots
            slots = np.zeros(0, dtype=np.int64)
        else:
            slots = block_tables[rows, positions // bs].astype(np.int64) * bs + positions % bs
        is_decode = num_new == 1
        num_decodes = count if is_decode.all() else int(np.argmin(is_decode))  # decodes lead the batch
        seq_lens_host = seq_lens.tolist()
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slots),
            query_start_loc=self._to_device(starts.astype(np.int32)),
            seq_lens=self._to_device(seq_lens.astype(np.int32)),
            block_tables=self._to_device(block_tables),
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            max_seq_len=max(seq_lens_host),
            query_start_loc_host=starts.tolist(),
            seq_lens_host=seq_lens_host,
        )
        input_ids = self._to_device(batch.input_ids)
        if batch.position_shifts is not None:
            positions = positions + batch.position_shifts
        if batch.images and isinstance(self.model.rotary, MRotaryEmbedding):
            positions = self._place_image_positions(batch.images, positions)
        return input_ids, self._to_device(positions.astype(np.int64, copy=False)), meta

    def _place_image_positions(self, images: list[ImageSlice], positions: np.ndarray) -> np.ndarray:
        """`positions` with the image tokens' pointing at rotary rows written for their (temporal, height, width)
        ids: Qwen2-VL's, from where the image starts (the position its first token would have as text) along its
        token grid."""
        positions = positions.copy()
        ids, tokens = [], []
        for piece in images:
            _, height, width = self.model.image_grid(piece.pixels.shape)
            index = np.arange(piece.image_start, piece.image_start + piece.count)
            grid = np.stack([index // (height * width), index // width % height, index % width], axis=1)
            ids.append(grid + (positions[piece.batch_start] - piece.image_start))
            tokens.append(np.arange(piece.batch_start, piece.batch_start + piece.count))
        first_row = self.model.rotary.place(torch.from_numpy(np.concatenate(ids)))
        positions[np.concatenate(tokens)] = first_row + np.arange(sum(piece.count for piece in images))
        return positions

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """Host array -> device tensor; on CUDA through pinned memory, asynchronously (no stream sync)."""
        return to_device(torch.from_numpy(array), self.device)


def _padded_block_tables(tables: list[list[int]]) -> np.ndarray:
    """[S, max blocks] int32, each row padded with block 0, built without a per-element Python loop."""
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    width = int(lengths.max()) if len(tables) else 0
    out = np.zeros((len(tables), width), dtype=np.int32)
    flat = np.fromiter(chain.from_iterable(tables), dtype=np.int32, count=int(lengths.sum()))
    out[np.arange(width)[None, :] < lengths[:, None]] = flat
    return out
