"""Reference attention backend in plain PyTorch: correct everywhere, fast enough on CPU.

Caches are [num_blocks, block_size, kv_heads, head_dim]. Decodes are batched: their blocks are gathered
into one padded tensor and attended with a length mask. Prefill chunks run one sequence at a time; a
chunk that starts at position 0 attends only to its own keys, so it needs no gather at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.model.attention.base import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def write_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, key)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, value)

    def forward(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        self.write_kv(key, value, k_cache, v_cache, meta)
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
                k, v = key[lo:hi], value[lo:hi]
            else:
                k, v = self._gather(k_cache, v_cache, meta.block_tables[i], context)
            out[lo:hi] = self._prefill(query[lo:hi], k, v)
        return out

    def _gather(self, k_cache, v_cache, block_table, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        num_blocks = -(-context // self.block_size)
        blocks = block_table[:num_blocks].long()
        k = k_cache[blocks].flatten(0, 1)[:context]
        v = v_cache[blocks].flatten(0, 1)[:context]
        return k, v

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [n, H, D] are the last n positions of a context of length k.shape[0].
        n, context = q.shape[0], k.shape[0]
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if n == context:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            q_pos = torch.arange(context - n, context, device=q.device)
            mask = q_pos[:, None] >= torch.arange(context, device=q.device)[None, :]
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o.transpose(0, 1)

    def _decode(self, q: torch.Tensor, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        nd = meta.num_decodes
        max_len = max(meta.seq_lens_host[:nd])
        max_blocks = -(-max_len // self.block_size)
        tables = meta.block_tables[:nd, :max_blocks].long()
        k = k_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)  # [B, KVH, L, D]
        v = v_cache[tables].flatten(1, 2)[:, :max_len].transpose(1, 2)
        lens = meta.seq_lens[:nd].to(q.device)
        mask = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]  # [B, L]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=self.scale, enable_gqa=True
        )
        return o.squeeze(2)
