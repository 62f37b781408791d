"""The attention backend interface: how a model layer reads and writes the paged KV cache.

The model runner describes each step's flattened batch with an `AttentionMetadata`; a backend writes
the step's new keys and values into their cache slots and computes attention for every query token.
Sequences are ordered decodes first (one query token each), then prefill chunks.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from llmserve.model.layers import RotaryEmbedding


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # [S + 1] int32: where each sequence's query tokens start in the batch
    seq_lens: torch.Tensor  # [S] int32: context length of each sequence after this step
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    num_decodes: int  # the first `num_decodes` sequences have exactly one query token
    num_decode_tokens: int
    max_seq_len: int
    # Host copies, so backends that loop over prefill sequences don't sync the device per sequence.
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    # Whatever a backend derives once per step and reuses in every layer (see `AttentionBackend.prepare`).
    backend_data: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


class AttentionBackend(ABC):
    name: str = "abstract"
    # KV cache dtypes other than the model dtype that this backend stores and reads, and why not others.
    quantized_kv_cache_dtypes: tuple[torch.dtype, ...] = ()
    no_quantized_kv_cache_reason = "it keeps the KV cache in the model dtype"

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype = torch.float32,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype
        if self.kv_cache_dtype != dtype and self.kv_cache_dtype not in self.quantized_kv_cache_dtypes:
            raise ValueError(
                f"The {self.name!r} attention backend cannot keep the KV cache in {self.kv_cache_dtype}: "
                f"{self.no_quantized_kv_cache_reason}."
            )
        # Per-tensor scales of a quantized cache: stored = value / scale. 1.0 unless calibrated scales are set.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.scale = head_dim**-0.5

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's key (and value) cache; the backend chooses the layout it reads best."""
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def kv_bytes_per_token(self) -> int:
        """Bytes a token takes in one layer's key and value caches, whatever the layout holds beside the values."""
        element = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return 2 * math.prod(self.kv_cache_shape(1)) * element // self.block_size

    def separate_kv_writes(self) -> None:  # noqa: B027 - optional hook
        """Write every new key and value of a step before any of its rows attends (a backend that writes a
        decode row's own KV in its attention launch stops): rows may be later positions of one sequence
        (speculative drafts), each reading the KV of those before it."""

    def prepare(self, meta: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Called once per step before the forward pass, to precompute per-step tensors."""

    @abstractmethod
    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Store the step's new keys/values ([T, kv_heads, head_dim]) at `meta.slot_mapping`."""

    @abstractmethod
    def attend(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Causal attention of `query` ([T, heads, head_dim]) over each sequence's cached context."""

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
        rotary: RotaryEmbedding | None = None, positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the step's tokens after their keys and values are stored. With the model's `rotary`
        embedding and the tokens' `positions`, query and key are rotated first (a backend may do that as
        it writes the keys)."""
        if rotary is not None:
            query, key = rotary(positions, query, key)
        self.write_kv(key, value, k_cache, v_cache, meta)
        return self.attend_written(query, key, value, k_cache, v_cache, meta)

    def attend_written(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
    ) -> torch.Tensor:
        """`attend` right after `write_kv(key, value, ...)`: a backend may read the new keys and values there."""
        return self.attend(query, k_cache, v_cache, meta)
