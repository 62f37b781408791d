"""The model runner: owns the weights and the KV cache tensors, turns a scheduled batch into one
forward pass over its flattened tokens, and samples the next tokens.

On CUDA it also sizes the KV pool from a profiling step, replays CUDA graphs for decode-only steps
(`cuda_graphs`), and keeps the step free of host syncs: every input tensor is built on the host and
sent before the forward pass is launched, so the only device->host read of a step is the engine's
read of the sampled ids (and logprobs, when asked for).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from llmserve.config import EngineConfig
from llmserve.engine.sequence import Sequence
from llmserve.model.attention import AttentionBackend, AttentionMetadata, get_backend
from llmserve.model.config import ModelConfig, parse_dtype
from llmserve.model.cuda_graphs import (
    GRAPH_SAFE_BACKENDS,
    CudaGraphCapture,
    DecodeGraphs,
    GraphCapture,
    graph_batch_sizes,
    make_model_forward,
)
from llmserve.model.dummy_weights import init_dummy_weights_
from llmserve.model.loader import iterate_weights
from llmserve.model.memory import MemoryProfile, kv_cache_budget, num_kv_blocks, profile_prompt_lengths
from llmserve.model.registry import model_class
from llmserve.sampling.params import SamplingParams
from llmserve.sampling.sampler import Sampler, SamplerOutput, SamplingMetadata, SamplingRow

logger = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]

# The profiling step samples with the most expensive settings (full-vocabulary sort, top logprobs).
_PROFILE_SAMPLING = SamplingParams(temperature=1.0, top_p=0.95, logprobs=20)


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
class StepInputs:
    """Everything one step sends to the device, built before the forward pass is launched."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_index: torch.Tensor | None  # [R] rows of the hidden states to sample from
    sampling: SamplingMetadata | None


@dataclass
class _ProfileSequence:
    """The fields of a `Sequence` that `prepare_inputs` reads, for the profiling step's dummy prompts."""

    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int = 0


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_dir, max_model_len: int) -> None:
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config.dtype, self.device)
        model_config.dtype = self.dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.model = self._load_model(model_dir, max_model_len)
        self.attn_backend = choose_attention_backend(config.attention_backend, self.device)(
            model_config.num_attention_heads, model_config.num_key_value_heads, model_config.head_dim, self.block_size,
            self.dtype,
        )
        self.sampler = Sampler()
        self.memory_profile: MemoryProfile | None = None
        self.num_blocks = self._decide_num_blocks()
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        self.graphs: DecodeGraphs | None = None
        if self._use_cuda_graphs():
            self._capture_or_run_eagerly()

    # ---- setup ----------------------------------------------------------------------------------
    def _load_model(self, model_dir, max_model_len: int) -> torch.nn.Module:
        cls = model_class(self.model_config.architecture)
        with torch.device(self.device):
            model = cls(self.model_config, max_positions=max_model_len)
        if self.config.load_format == "dummy":
            init_dummy_weights_(model, self.config.seed)
        else:
            model.load_weights(iterate_weights(model_dir))
        return model.eval()

    def _decide_num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = self.model_config.kv_bytes_per_token(self.dtype) * self.block_size
        if self.device.type != "cuda":
            return max(1, self.config.kv_cache_memory // per_block)
        self.memory_profile = self.profile_memory()
        budget = kv_cache_budget(self.memory_profile, self.config.gpu_memory_utilization)
        blocks = num_kv_blocks(budget, per_block)
        logger.info(
            "KV cache: %.2f GiB for %d blocks (peak without KV %.2f GiB, outside torch %.2f GiB, device %.2f GiB)",
            blocks * per_block / (1 << 30), blocks, self.memory_profile.peak_torch_bytes / (1 << 30),
            self.memory_profile.non_torch_bytes / (1 << 30), self.memory_profile.total_bytes / (1 << 30),
        )
        return blocks

    def _allocate_kv_cache(self, num_blocks: int) -> KVCaches:
        shape = self.attn_backend.kv_cache_shape(num_blocks)
        # Zeros, not empty: padded block-table entries read block contents that the mask then ignores,
        # and uninitialised memory could hold NaNs that survive a zero attention weight.
        return [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.model_config.num_hidden_layers)
        ]

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
        lengths = profile_prompt_lengths(self.config.max_num_batched_tokens, self.max_model_len)
        batch: list[tuple[_ProfileSequence, int]] = []
        next_block = 0
        for length in lengths:
            blocks = -(-length // self.block_size)
            table = list(range(next_block, next_block + blocks))
            batch.append((_ProfileSequence(token_ids=[0] * length, block_table=table), length))
            next_block += blocks
        scratch = self._allocate_kv_cache(next_block)
        scratch_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in scratch)
        num_rows = self.config.max_num_seqs
        logits_rows = [i % len(batch) for i in range(num_rows)]
        rows = [SamplingRow(_PROFILE_SAMPLING, seed=i, sample_index=0, prompt_token_ids=(), output_token_ids=())
                for i in range(num_rows)]
        inputs = self.prepare_step(batch, logits_rows, rows)  # type: ignore[arg-type]
        output = self._run(inputs, scratch, use_graph=False)
        assert output is not None
        output.token_ids.cpu()  # wait for the step, so its memory is all accounted
        del scratch
        return scratch_bytes

    # ---- CUDA graphs ----------------------------------------------------------------------------
    def _use_cuda_graphs(self) -> bool:
        if self.device.type != "cuda" or self.config.enforce_eager:
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
    def execute(
        self,
        batch: list[tuple[Sequence, int]],
        logits_rows: list[int],
        sampling_rows: list[SamplingRow],
        blocks_to_copy: Sequence_[tuple[int, int]] = (),
    ) -> SamplerOutput | None:
        """Copy the (src, dst) blocks of `blocks_to_copy`, run `batch` (decodes first) and sample one
        token per entry of `logits_rows` (an index into `batch`: that sequence's last scheduled token
        gives the logits)."""
        if blocks_to_copy:
            self.copy_blocks(blocks_to_copy)
        inputs = self.prepare_step(batch, logits_rows, sampling_rows)
        return self.run_step(inputs)

    @torch.inference_mode()
    def run_step(self, inputs: StepInputs) -> SamplerOutput | None:
        """Launch the forward pass (a graph replay when one fits) and the sampler; no host sync."""
        return self._run(inputs, self.kv_caches, use_graph=self.graphs is not None)

    def _run(self, inputs: StepInputs, kv_caches: KVCaches, use_graph: bool) -> SamplerOutput | None:
        meta = inputs.meta
        if use_graph and self.graphs is not None and self.graphs.size_for(meta) is not None:
            hidden = self.graphs.run(inputs.input_ids, inputs.positions, meta)
        else:
            self.attn_backend.prepare(meta)
            hidden = self.model(inputs.input_ids, inputs.positions, kv_caches, self.attn_backend, meta)
        if inputs.logits_index is None or inputs.sampling is None:
            return None  # only partial prefill chunks: the KV cache was the point
        logits = self.model.compute_logits(hidden[inputs.logits_index])
        return self.sampler(logits, inputs.sampling)

    def copy_blocks(self, blocks_to_copy: Sequence_[tuple[int, int]]) -> None:
        """Copy whole KV blocks, every layer's keys and values (block is the caches' first dimension)."""
        src = self._to_device(np.array([s for s, _ in blocks_to_copy], dtype=np.int64))
        dst = self._to_device(np.array([d for _, d in blocks_to_copy], dtype=np.int64))
        for key_cache, value_cache in self.kv_caches:
            key_cache[dst] = key_cache[src]
            value_cache[dst] = value_cache[src]

    # ---- inputs ---------------------------------------------------------------------------------
    def prepare_step(
        self, batch: list[tuple[Sequence, int]], logits_rows: list[int], sampling_rows: list[SamplingRow]
    ) -> StepInputs:
        """The step's device tensors: model inputs, the hidden-state rows to sample and the sampling
        metadata; all of it is sent before anything runs, so building it never waits on the device."""
        input_ids, positions, meta = self.prepare_inputs(batch)
        if not logits_rows:
            return StepInputs(input_ids, positions, meta, None, None)
        starts = meta.query_start_loc_host
        last_tokens = np.array([starts[row + 1] - 1 for row in logits_rows], dtype=np.int64)
        sampling = SamplingMetadata.build(sampling_rows, self.model_config.vocab_size, self.device)
        return StepInputs(input_ids, positions, meta, self._to_device(last_tokens), sampling)

    def prepare_inputs(self, batch: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flatten the batch: token ids, positions and KV slots of every scheduled token (numpy over the
        tokens: only the per-sequence reads are Python), plus the attention metadata."""
        count = len(batch)
        num_new = np.fromiter((n for _, n in batch), dtype=np.int64, count=count)
        begins = np.fromiter((seq.num_computed_tokens for seq, _ in batch), dtype=np.int64, count=count)
        seq_lens = begins + num_new
        starts = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(num_new, out=starts[1:])
        total = int(starts[-1])
        if total == count:  # decodes only: one token each
            positions = begins
            tokens = [seq.token_ids[begin] for (seq, _), begin in zip(batch, begins.tolist(), strict=True)]
            rows = np.arange(count)
        else:
            rows = np.repeat(np.arange(count), num_new)
            positions = np.arange(total) - np.repeat(starts[:-1] - begins, num_new)
            tokens = chain.from_iterable(
                seq.token_ids[begin:end]
                for (seq, _), begin, end in zip(batch, begins.tolist(), seq_lens.tolist(), strict=True)
            )
        block_tables = _padded_block_tables([seq.block_table for seq, _ in batch])
        bs = self.block_size
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
        input_ids = self._to_device(np.fromiter(tokens, dtype=np.int64, count=total))
        return input_ids, self._to_device(positions.astype(np.int64, copy=False)), meta

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """Host array -> device tensor; on CUDA through pinned memory, asynchronously (no stream sync)."""
        tensor = torch.from_numpy(array)
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)


def _padded_block_tables(tables: list[list[int]]) -> np.ndarray:
    """[S, max blocks] int32, each row padded with block 0, built without a per-element Python loop."""
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    width = int(lengths.max()) if len(tables) else 0
    out = np.zeros((len(tables), width), dtype=np.int32)
    flat = np.fromiter(chain.from_iterable(tables), dtype=np.int32, count=int(lengths.sum()))
    out[np.arange(width)[None, :] < lengths[:, None]] = flat
    return out
