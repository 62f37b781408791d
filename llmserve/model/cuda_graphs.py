"""CUDA graphs for decode-only steps.

A decode step of a given batch size launches the same kernels with the same shapes every time; only
the values in a handful of small input tensors change. So the forward pass is captured once per batch
size in a ladder (1, 2, 4, 8, 16, 32, ...) on static input buffers, and a step of `n` sequences copies
its inputs into those buffers, pads them up to the nearest captured size and replays that graph: one
launch instead of hundreds. Mixed steps (any prefill chunk) and batches above the largest captured
size run eagerly.

Each graph is captured with `max_seq_len` = max_model_len, so it serves every context length: the
attention backend's launch shapes may depend only on the number of decodes and `meta.max_seq_len`.
Padded rows write no KV (slot -1, which the backend must skip), attend over one cached token of
block 0, and their outputs are dropped.

The capture itself is pluggable: `CudaGraphCapture` records real CUDA graphs; `EagerReplay` re-runs
the same function on the same static buffers, which lets the padding be tested without a GPU.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from llmserve.model.attention import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)

MAX_DEFAULT_GRAPH_BATCH = 512
GRAPH_SAFE_BACKENDS: frozenset[str] = frozenset({"triton"})  # launch shapes depend on no per-step host value
PAD_SLOT = -1


def graph_batch_sizes(max_num_seqs: int, configured: Sequence[int] | None = None) -> list[int]:
    """The decode batch sizes to capture, ascending: `configured`, else 1, 2, 4, 8 and multiples of 16,
    never above `max_num_seqs` (and 512), and always including the largest batch the engine runs
    when it is within that cap."""
    if configured is not None:
        return sorted({size for size in configured if size <= max_num_seqs})
    cap = min(max_num_seqs, MAX_DEFAULT_GRAPH_BATCH)
    sizes = {size for size in (1, 2, 4, 8) if size <= cap}
    sizes.update(range(16, cap + 1, 16))
    sizes.add(cap)
    return sorted(sizes)


def padded_batch_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds `num_seqs` sequences; None when none does."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


def graph_size_for(num_seqs: int, num_decodes: int, sizes: Sequence[int]) -> int | None:
    """Which graph runs a step: a captured size for decode-only steps that fit, else None (eager)."""
    if num_seqs == 0 or num_decodes != num_seqs:
        return None
    return padded_batch_size(num_seqs, sizes)


class GraphCapture(Protocol):
    """Turns a zero-argument forward over static buffers into a replayable step."""

    def capture(self, forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]: ...


class CudaGraphCapture:
    """Records each forward as a CUDA graph; all graphs share one memory pool (capture largest first)."""

    def __init__(self) -> None:
        self._pool = None

    def capture(self, forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        forward()  # warm-up: compiles kernels and sizes library workspaces outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = forward()
        if self._pool is None:
            self._pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay


class EagerReplay:
    """Replays by running the forward again on the static buffers: the graph path's semantics on any device."""

    def capture(self, forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        return forward


@dataclass
class StaticDecodeInputs:
    """The buffers every decode graph reads, sized for the largest graph."""

    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor  # [max_bs] int64
    slot_mapping: torch.Tensor  # [max_bs] int64, PAD_SLOT in padded rows
    seq_lens: torch.Tensor  # [max_bs] int32, 1 in padded rows
    block_tables: torch.Tensor  # [max_bs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [max_bs + 1] int32: always 0, 1, 2, ... (one token per sequence)

    @classmethod
    def allocate(cls, max_batch: int, max_blocks_per_seq: int, device: torch.device) -> StaticDecodeInputs:
        return cls(
            input_ids=torch.zeros(max_batch, dtype=torch.long, device=device),
            positions=torch.zeros(max_batch, dtype=torch.long, device=device),
            slot_mapping=torch.full((max_batch,), PAD_SLOT, dtype=torch.long, device=device),
            seq_lens=torch.ones(max_batch, dtype=torch.int32, device=device),
            block_tables=torch.zeros(max_batch, max_blocks_per_seq, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
        )

    def capture_metadata(self, batch: int, max_seq_len: int) -> AttentionMetadata:
        """Metadata over the first `batch` rows; host-side lengths are the worst case (max_seq_len)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            num_decodes=batch,
            num_decode_tokens=batch,
            max_seq_len=max_seq_len,
            query_start_loc_host=list(range(batch + 1)),
            seq_lens_host=[max_seq_len] * batch,
        )

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, batch: int) -> None:
        """Copy a decode step of `n` sequences into rows [0, n) and pad rows [n, batch)."""
        n = input_ids.shape[0]
        width = meta.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            raise ValueError(f"block table of {width} blocks exceeds the captured {self.block_tables.shape[1]}")
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if batch > n:
            self.input_ids[n:batch].zero_()
            self.positions[n:batch].zero_()
            self.slot_mapping[n:batch].fill_(PAD_SLOT)
            self.seq_lens[n:batch].fill_(1)
            self.block_tables[n:batch].zero_()


ModelForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeGraphs:
    """One captured decode step per batch size; `run` pads a decode-only step and replays."""

    def __init__(
        self, forward: ModelForward, backend: AttentionBackend, sizes: Sequence[int], max_seq_len: int,
        block_size: int, device: torch.device, capture: GraphCapture,
    ) -> None:
        if not sizes:
            raise ValueError("no CUDA graph batch sizes to capture")
        self.sizes = sorted(sizes)
        self.max_seq_len = max_seq_len
        max_blocks = -(-max_seq_len // block_size)
        self.inputs = StaticDecodeInputs.allocate(self.sizes[-1], max_blocks, device)
        self._steps: dict[int, Callable[[], torch.Tensor]] = {}
        for batch in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            self._steps[batch] = capture.capture(self._forward_fn(forward, backend, batch))

    def _forward_fn(self, forward: ModelForward, backend: AttentionBackend, batch: int) -> Callable[[], torch.Tensor]:
        meta = self.inputs.capture_metadata(batch, self.max_seq_len)
        input_ids, positions = self.inputs.input_ids[:batch], self.inputs.positions[:batch]

        def step() -> torch.Tensor:
            meta.backend_data.clear()
            backend.prepare(meta)
            return forward(input_ids, positions, meta)

        return step

    def size_for(self, meta: AttentionMetadata) -> int | None:
        return graph_size_for(meta.num_seqs, meta.num_decodes, self.sizes)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of a decode-only step ([n, hidden]); the step must fit (see `size_for`)."""
        batch = self.size_for(meta)
        if batch is None:
            raise ValueError(f"no captured graph for {meta.num_seqs} sequences ({meta.num_decodes} decodes)")
        self.inputs.load(input_ids, positions, meta, batch)
        return self._steps[batch]()[: input_ids.shape[0]]


def make_model_forward(model: nn.Module, kv_caches, backend: AttentionBackend) -> ModelForward:
    def forward(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return model(input_ids, positions, kv_caches, backend, meta)

    return forward
