"""Reference attention backend in plain PyTorch: correct everywhere, and fast enough on CPU.

Cache layout is [num_blocks, kv_heads, block_size, head_dim], so gathering a sequence's blocks per
KV head (one `index_select` over rows of block_size * head_dim elements) yields each head's keys as one
contiguous [context, head_dim] matrix, ready for a batched matmul without further copies. Gathers go
into workspace buffers reused across layers and steps: fresh multi-megabyte allocations would be
page-faulted in on every call, which costs more than the attention itself on CPU.

Decodes (one query token each) go through a C kernel on CPU (`cpu_kernels`, built on first use) that
reads the blocks in place; without it they are gathered and batched; prefill chunks run one sequence at a time, and a chunk
that starts at position 0 attends to its own new keys without touching the cache.

With `--kv-cache-dtype int8` the cache holds int8 rows with a scale each (`int8_kv`): new keys and values are
quantized as they are written, the C kernel reads them in place (bf16 models), and the gathering paths
dequantize what they gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.model.attention import cpu_kernels, int8_kv
from llmserve.model.attention.base import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    quantized_kv_cache_dtypes = (torch.int8,)
    no_quantized_kv_cache_reason = (
        "it quantizes the KV cache to int8 (--kv-cache-dtype int8), not to fp8: these CPUs have no fp8 "
        "conversion instructions; --kv-cache-dtype fp8 needs the 'triton' backend on a CUDA GPU"
    )

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype = torch.float32,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, dtype, kv_cache_dtype)
        self.group = num_heads // num_kv_heads
        self._workspace: dict[str, torch.Tensor] = {}
        self.int8_cache = self.kv_cache_dtype == torch.int8
        self._kernel_fits = cpu_kernels.supports(dtype, num_heads, num_kv_heads, head_dim, self.kv_cache_dtype)

    def _use_kernel(self, meta: AttentionMetadata) -> bool:
        """Decodes on CPU go through the C kernel when it built and handles this dtype and shape."""
        return self._kernel_fits and meta.block_tables.device.type == "cpu" and cpu_kernels.load() is not None

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.int8_cache:
            return int8_kv.cache_shape(num_blocks, self.num_kv_heads, self.block_size, self.head_dim)
        return (num_blocks, self.num_kv_heads, self.block_size, self.head_dim)

    # ---- per step -------------------------------------------------------------------------------
    def prepare(self, meta: AttentionMetadata) -> None:
        data = meta.backend_data
        data["slot_block"] = meta.slot_mapping // self.block_size
        data["slot_offset"] = meta.slot_mapping % self.block_size
        nd = meta.num_decodes
        data["decode_kernel"] = nd > 0 and self._use_kernel(meta)
        if nd and not data["decode_kernel"]:
            max_len = max(meta.seq_lens_host[:nd])
            num_blocks = -(-max_len // self.block_size)
            tables = meta.block_tables[:nd, :num_blocks].long()
            data["decode_rows"] = self._head_rows(tables)  # [nd * kv_heads * num_blocks]
            data["decode_len"] = num_blocks * self.block_size
            positions = torch.arange(num_blocks * self.block_size, device=tables.device)
            masked = positions[None, :] >= meta.seq_lens[:nd, None].long()
            data["decode_bias"] = torch.zeros(masked.shape, device=tables.device).masked_fill_(masked, float("-inf"))

    def _head_rows(self, tables: torch.Tensor) -> torch.Tensor:
        """Row ids into the cache viewed as [num_blocks * kv_heads, block_size * head_dim], ordered
        (sequence, kv head, block) so each head's context comes out contiguous."""
        heads = torch.arange(self.num_kv_heads, device=tables.device)
        rows = tables[:, None, :] * self.num_kv_heads + heads[None, :, None]
        return rows.reshape(-1)

    # ---- per layer ------------------------------------------------------------------------------
    def write_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        blocks, offsets = meta.backend_data["slot_block"], meta.backend_data["slot_offset"]
        if self.int8_cache:
            int8_kv.write(k_cache, blocks, offsets, key)
            int8_kv.write(v_cache, blocks, offsets, value)
            return
        k_cache[blocks, :, offsets] = key
        v_cache[blocks, :, offsets] = value

    def attend_written(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        return self._attend(query, key, value, k_cache, v_cache, meta)

    def attend(self, query, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        return self._attend(query, None, None, k_cache, v_cache, meta)

    def _attend(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(query)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(query[:nd], k_cache, v_cache, meta)
        starts, lens = meta.query_start_loc_host, meta.seq_lens_host
        for i in range(nd, meta.num_seqs):
            lo, hi = starts[i], starts[i + 1]
            context = lens[i]
            if key is not None and hi - lo == context:  # fresh prompt: its own keys are the whole context
                k, v = key[lo:hi].transpose(0, 1), value[lo:hi].transpose(0, 1)
            else:
                num_blocks = -(-context // self.block_size)
                rows = self._head_rows(meta.block_tables[i : i + 1, :num_blocks].long())
                k = self._gather(k_cache, rows, num_blocks, "k")[:, :context]
                v = self._gather(v_cache, rows, num_blocks, "v")[:, :context]
            out[lo:hi] = self._prefill(query[lo:hi], k, v)
        return out

    def _gather(self, cache: torch.Tensor, rows: torch.Tensor, blocks_per_head: int, name: str) -> torch.Tensor:
        """The selected (block, head) rows of `cache` as [seqs * kv_heads, blocks_per_head * block_size, D], in
        the model dtype."""
        row_size = cache[0, 0].numel()
        out = self._buffer(name, rows.numel() * row_size, cache.dtype, cache.device).view(rows.numel(), row_size)
        torch.index_select(cache.view(-1, row_size), 0, rows, out=out)
        if self.int8_cache:
            values = self.block_size * self.head_dim
            dequantized = self._buffer(name + "_dequantized", rows.numel() * values, self.dtype, cache.device)
            out = int8_kv.dequantize(out, self.block_size, self.head_dim, dequantized.view(-1, self.block_size, self.head_dim))
        return out.view(-1, blocks_per_head * self.block_size, self.head_dim)

    def _buffer(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._workspace.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(int(numel * 1.25), dtype=dtype, device=device)  # headroom: fewer regrowths
            self._workspace[name] = buf
        return buf[:numel]

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [n, H, D], the last n positions of a context of k.shape[1] keys; k, v: [KVH, context, D].
        # Batched 4-D inputs: on CPU they take SDPA's flash kernel, 2-2.5x faster than 3-D ones.
        n, context = q.shape[0], k.shape[1]
        qh, k, v = q.transpose(0, 1).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        if n == context:
            o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            q_pos = torch.arange(context - n, context, device=q.device)
            mask = q_pos[:, None] >= torch.arange(context, device=q.device)[None, :]
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o[0].transpose(0, 1)

    def _decode(self, q: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        data = meta.backend_data
        if data["decode_kernel"]:
            nd = q.shape[0]
            return cpu_kernels.paged_decode(q, k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], self.scale)
        nd, kvh, group, dim = q.shape[0], self.num_kv_heads, self.group, self.head_dim
        length = data["decode_len"]
        blocks = length // self.block_size
        k = self._gather(k_cache, data["decode_rows"], blocks, "k")  # [nd * kvh, length, D]
        v = self._gather(v_cache, data["decode_rows"], blocks, "v")
        scores = torch.bmm(q.reshape(nd * kvh, group, dim), k.transpose(1, 2)).float()
        scores = scores.view(nd, kvh, group, length) * self.scale + data["decode_bias"][:, None, None, :]
        probs = scores.softmax(dim=-1).to(q.dtype).view(nd * kvh, group, length)
        return torch.bmm(probs, v).view(nd, kvh * group, dim)
