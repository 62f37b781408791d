"""Triton attention backend: paged decode with split-K, chunked prefill over the paged cache, KV write.

The kernels live in `triton_kernels` and are imported when the backend is constructed, so importing
llmserve needs no Triton. They run natively on CUDA tensors, and on CPU tensors in Triton's interpreter
when TRITON_INTERPRET=1 is set before the first construction (slow: meant for tests).

An fp8 (e4m3) cache stores value / scale with one scale per tensor for keys and one for values
(`k_scale`, `v_scale`, 1.0 unless set), saturated to e4m3's range; the kernels read e4m3 values into the
query dtype (exact) and fold the key scale into the softmax scale and the value scale into the output.

Cache layout is the torch reference's, [num_blocks, kv_heads, block_size, head_dim]: one KV head's slice
of a block is a contiguous block_size x head_dim tile.

Decode (one query token per sequence) launches a grid of (decodes, kv_heads, splits); each program
attends one GQA group over one slice of the context, and a merge kernel combines the slices when there
is more than one. The number of splits depends only on host ints (`num_decodes`, `max_seq_len`) and the
decode path never reads a device value on the host, so it can be captured in a CUDA graph: capture with
`max_seq_len` at its upper bound. The kernel cuts each sequence's own length into that many slices, so
a graph captured for max_model_len still spreads a short context over every split (at batch 1 on the
8B shape, cutting it into fixed slices for the bound left one program a 512-token loop: 15.5 us a layer
on an H200, 11% of the step; cut from each sequence's length, 4.4 us and 2.3 us for the merge). Merging
in the decode launch instead, by the last split to finish, was slower (8.5 us a layer): one program then
reads every split of its heads.

Where the model's rotary embedding would run as the fused Triton kernel, `forward` applies it in the KV
write's launch instead (`rotary_write_kv_kernel`): the query is rotated in place and the rotated keys go
straight to the cache. On the 8B shape at batch 1 that took the two kernels' 121 us a step to 86-92 us
(H200). With LLMSERVE_FOLD_ROTARY=1 a step of decodes alone goes one further: the decode launch rotates the
queries as it loads them, and the program whose slice holds a sequence's new position writes that token's
rotated key and value before it reads its slice (no launch of its own for the rotary and the KV write).

Prefill chunks are cut into tiles of query tokens (a schedule built on the host from
`query_start_loc_host`, once per step in `prepare`) and each (tile, kv head) program runs a
flash-attention loop over the sequence's cached context.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from llmserve.model import layers
from llmserve.model.attention.base import AttentionBackend, AttentionMetadata

# Whether a decode-only step's rotary embedding and KV write run inside its decode launch (`decode_kernel`'s
# ROTARY) rather than a launch of their own. Off until a GPU has timed it (BENCHMARKS.md, issue 18). Read at
# import; backends built after a change to it (benchmarks, tests) follow it.
FOLD_ROTARY_ENV = "LLMSERVE_FOLD_ROTARY"
fold_rotary: bool = os.environ.get(FOLD_ROTARY_ENV, "0").strip().lower() in ("1", "true", "on", "yes")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")  # as triton reads it


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    # Tuning knobs (instance attributes may override them, e.g. tests forcing many small splits).
    decode_tile = 64  # context positions per decode iteration
    prefill_tile = 64  # context positions per prefill iteration
    prefill_rows = 64  # query rows (tokens x heads of a GQA group) per prefill program
    min_split_tokens = 128  # splits for a batch's length bound: at least this many positions each there
    max_splits = 64

    quantized_kv_cache_dtypes = (torch.float8_e4m3fn,)
    no_quantized_kv_cache_reason = (
        "it stores fp8 (e4m3) with per-tensor scales; --kv-cache-dtype int8 is the 'torch' backend's (CPU)"
    )

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype = torch.float32,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, dtype, kv_cache_dtype)
        self.interpret = _interpreting()
        if not torch.cuda.is_available() and not self.interpret:
            raise RuntimeError(
                "The 'triton' attention backend needs a CUDA GPU; without one, use attention_backend='torch', "
                "or set TRITON_INTERPRET=1 (before llmserve loads the kernels) to run it in Triton's "
                "interpreter on CPU, which is slow and meant for tests."
            )
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads}).")
        try:
            from llmserve.model.attention import triton_kernels
        except ImportError as e:
            raise RuntimeError(
                "The 'triton' attention backend needs the triton package (pip install 'llmserve[gpu]')."
            ) from e
        from llmserve import pdl
        from llmserve.model import fused_kernels

        self.kernels = triton_kernels
        self.fused_kernels = fused_kernels
        self.no_fp_fusion = fused_kernels.NO_FP_FUSION  # the decode launch's too: it may rotate as the rotary does
        self.pdl = pdl
        self.group = num_heads // num_kv_heads
        self.d_pad = max(16, _next_pow2(head_dim))
        self.kvh_pad = _next_pow2(num_kv_heads)
        self.group_pad = max(16, _next_pow2(self.group))  # tl.dot wants M >= 16
        self.prefill_group_pad = _next_pow2(self.group)
        self._target_programs: int | None = None
        # where the rotated halves make a whole head, a decode step's rotary and KV write can run in its decode launch
        self._rotary_in_decode = fold_rotary and head_dim == self.d_pad  # a power of two, 16 or more

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_kv_heads, self.block_size, self.head_dim)

    def separate_kv_writes(self) -> None:
        self._rotary_in_decode = False

    @property
    def _quantized_cache(self) -> bool:
        return self.kv_cache_dtype != self.dtype

    # ---- per step -------------------------------------------------------------------------------
    def prepare(self, meta: AttentionMetadata) -> None:
        device = meta.seq_lens.device
        if device.type != "cuda" and not self.interpret:
            raise RuntimeError(
                f"The 'triton' attention backend runs on CUDA tensors (got {device.type}); "
                "set TRITON_INTERPRET=1 to run it in Triton's interpreter on CPU."
            )
        data = meta.backend_data
        data["triton_splits"] = self._decode_splits(meta.num_decodes, meta.max_seq_len, device)
        data["triton_prefill_tiles"] = self._prefill_tiles(meta, device)

    def _decode_splits(self, num_decodes: int, max_seq_len: int, device: torch.device) -> int:
        """Splits per sequence for a decode batch: enough programs to fill the GPU when the batch alone
        does not, no more than give `min_split_tokens` each at the length bound. Host ints only (the
        kernel sizes each sequence's splits from its own length)."""
        tile = self.decode_tile
        tiles = max(1, -(-max_seq_len // tile))
        programs = max(1, num_decodes * self.num_kv_heads)
        target = self._programs_to_fill(device)
        if programs >= target:
            return 1
        min_tiles = max(1, self.min_split_tokens // tile)
        return max(1, min(-(-target // programs), tiles // min_tiles, self.max_splits))

    def _programs_to_fill(self, device: torch.device) -> int:
        if self._target_programs is None:
            if device.type == "cuda":
                self._target_programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
            else:
                self._target_programs = 16
        return self._target_programs

    def _prefill_tiles(self, meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, int] | None:
        """The prefill schedule: [2, tiles] int32 (sequence, first query token within its chunk)."""
        starts = meta.query_start_loc_host
        block_q = self._prefill_block_q()
        seqs: list[int] = []
        firsts: list[int] = []
        for i in range(meta.num_decodes, meta.num_seqs):
            n = starts[i + 1] - starts[i]
            for first in range(0, n, block_q):
                seqs.append(i)
                firsts.append(first)
        if not seqs:
            return None
        return torch.tensor([seqs, firsts], dtype=torch.int32).to(device, non_blocking=True), len(seqs)

    def _prefill_block_q(self) -> int:
        return max(1, max(16, self.prefill_rows) // self.prefill_group_pad)

    # ---- per layer ------------------------------------------------------------------------------
    def forward(
        self, query, key, value, k_cache, v_cache, meta: AttentionMetadata,
        rotary: layers.RotaryEmbedding | None = None, positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Where the model's rotary embedding would run as the fused Triton kernel, it runs inside the KV
        write instead: one launch a layer fewer, and the rotated keys are written to the cache alone."""
        if rotary is None or layers.fused_kernels_for(query) is not self.fused_kernels:
            return super().forward(query, key, value, k_cache, v_cache, meta, rotary, positions)
        query = _last_dim_contiguous(query)
        if meta.num_decodes == meta.num_seqs and self._rotary_in_decode:
            key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
            return self.attend(query, k_cache, v_cache, meta, _NewTokens(rotary, positions, key, value, meta.slot_mapping))
        self._rotate_and_write_kv(rotary, positions, query, key, value, k_cache, v_cache, meta)
        return self.attend(query, k_cache, v_cache, meta)

    def _rotate_and_write_kv(self, rotary, positions, query, key, value, k_cache, v_cache, meta) -> None:
        """Rotate query in place and store the rotated keys and the values at `meta.slot_mapping`."""
        tokens = query.shape[0]
        if tokens == 0:
            return
        key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
        half = self.head_dim // 2
        self.kernels.rotary_write_kv_kernel[(tokens,)](
            positions, query, key, value, rotary.cos_cache, rotary.sin_cache, k_cache, v_cache, meta.slot_mapping,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            rotary.cos_cache.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            1.0 / self.k_scale, 1.0 / self.v_scale,
            NUM_Q_HEADS=self.num_heads, Q_HEADS_PAD=_next_pow2(self.num_heads), NUM_KV_HEADS=self.num_kv_heads,
            KVH_PAD=self.kvh_pad, HEAD_DIM=self.head_dim, D_PAD=self.d_pad, HALF=half, HALF_PAD=_next_pow2(half),
            BLOCK_SIZE=self.block_size, QUANTIZED=self._quantized_cache, num_warps=4,
            **self.fused_kernels.NO_FP_FUSION, **self.pdl.launch_options(query),
        )

    def write_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        tokens = key.shape[0]
        if tokens == 0:
            return
        key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
        self.kernels.write_kv_kernel[(tokens,)](
            key, value, k_cache, v_cache, meta.slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), 1.0 / self.k_scale, 1.0 / self.v_scale,
            NUM_KV_HEADS=self.num_kv_heads, HEAD_DIM=self.head_dim, BLOCK_SIZE=self.block_size,
            KVH_PAD=self.kvh_pad, D_PAD=self.d_pad, QUANTIZED=self._quantized_cache, **self.pdl.launch_options(key),
        )

    def attend(self, query, k_cache, v_cache, meta: AttentionMetadata, new: _NewTokens | None = None) -> torch.Tensor:
        """Attention of every query over its cached context. With `new` (decodes only), query is not rotated yet
        and the new tokens' keys and values are not in the cache: the decode launch does both."""
        query = _last_dim_contiguous(query)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        data = meta.backend_data
        precision = "ieee" if query.dtype == torch.float32 else "tf32"  # no TF32 rounding of float32
        if "triton_splits" not in data:
            self.prepare(meta)
        if meta.num_decodes:
            self._decode(query, k_cache, v_cache, out, meta, precision, data["triton_splits"], new)
        tiles = data["triton_prefill_tiles"]
        if tiles is not None:
            self._prefill(query, k_cache, v_cache, out, meta, precision, *tiles)
        return out

    def _decode(
        self, query, k_cache, v_cache, out, meta: AttentionMetadata, precision: str, splits: int,
        new: _NewTokens | None,
    ) -> None:
        nd = meta.num_decodes
        kernels = self.kernels
        if splits > 1:
            part_acc = torch.empty((nd, self.num_heads, splits, self.d_pad), dtype=torch.float32, device=query.device)
            part_m = torch.empty((nd, self.num_heads, splits), dtype=torch.float32, device=query.device)
            part_l = torch.empty_like(part_m)
        else:
            part_acc = part_m = part_l = out  # unused
        kernels.decode_kernel[(nd, self.num_kv_heads, splits)](
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
            out, part_acc, part_m, part_l,
            self.scale * self.k_scale * _LOG2E, self.v_scale,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
            *self._new_token_args(new, query),
            NUM_KV_HEADS=self.num_kv_heads, GROUP=self.group, HEAD_DIM=self.head_dim, BLOCK_SIZE=self.block_size,
            GROUP_PAD=self.group_pad, D_PAD=self.d_pad, TILE_N=self.decode_tile, NUM_SPLITS=splits,
            DOT_PRECISION=precision, ROTARY=new is not None, QUANTIZED=self._quantized_cache,
            **self.no_fp_fusion, **self.pdl.launch_options(query),
        )
        if splits > 1:
            kernels.merge_splits_kernel[(nd, self.num_heads)](
                out, part_acc, part_m, part_l, self.v_scale, out.stride(0), out.stride(1),
                NUM_HEADS=self.num_heads, HEAD_DIM=self.head_dim, D_PAD=self.d_pad,
                NUM_SPLITS=splits, SPLITS_PAD=_next_pow2(splits), **self.pdl.launch_options(out),
            )

    def _new_token_args(self, new: _NewTokens | None, query: torch.Tensor) -> tuple:
        """The decode launch's arguments for its rotary and KV write (placeholders without `new`)."""
        if new is None:
            return (query,) * 6 + (0,) * 5 + (1.0, 1.0)
        cos, sin = new.rotary.cos_cache, new.rotary.sin_cache
        return (new.positions, new.key, new.value, cos, sin, new.slot_mapping, new.key.stride(0), new.key.stride(1),
                new.value.stride(0), new.value.stride(1), cos.stride(0), 1.0 / self.k_scale, 1.0 / self.v_scale)

    def _prefill(
        self, query, k_cache, v_cache, out, meta: AttentionMetadata, precision: str, tiles: torch.Tensor, count: int
    ) -> None:
        self.kernels.prefill_kernel[(count, self.num_kv_heads)](
            query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, tiles,
            out, self.scale * self.k_scale * _LOG2E, self.v_scale, count,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
            GROUP=self.group, HEAD_DIM=self.head_dim, BLOCK_SIZE=self.block_size,
            GROUP_PAD=self.prefill_group_pad, D_PAD=self.d_pad, BLOCK_Q=self._prefill_block_q(),
            TILE_N=self.prefill_tile, DOT_PRECISION=precision, **self.pdl.launch_options(query),
        )


_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class _NewTokens:
    """A decode step's new tokens, not rotated and not in the cache yet: what the decode launch needs to do both."""

    rotary: layers.RotaryEmbedding
    positions: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    slot_mapping: torch.Tensor


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
