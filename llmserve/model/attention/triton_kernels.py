"""Triton kernels for paged attention: KV write (also with the rotary embedding of q and k in the same
launch), split-K paged decode (+ split merge), and prefill / chunked prefill over the paged cache.

Cache layout (shared with the torch reference): [num_blocks, kv_heads, block_size, head_dim], head dim
contiguous. Tokens of a context are addressed one by one through the block table (token j lives in
block `block_table[j // BLOCK_SIZE]` at offset `j % BLOCK_SIZE`), so a key tile may span several cache
blocks and its length need not match the block size.

Every kernel handles all query heads of one GQA group at once: the group's query rows are stacked into
the M dimension of the score tile, so each key/value tile is loaded once per KV head, not once per query
head. Scores are kept in the log2 domain (scale * log2(e) folded into the scores, `exp2` everywhere);
softmax statistics and the accumulator are float32.

Importing this module compiles nothing; with TRITON_INTERPRET=1 set before the import, the kernels run
in Triton's interpreter on CPU tensors.
"""

from __future__ import annotations

import triton
import triton.language as tl

from llmserve import pdl
from llmserve.model.fused_kernels import rotary_cos_sin, rotate_heads, rotated_halves

# Running maximum before any key was seen: finite, so rows whose keys are all masked in a tile (or a
# split with no keys at all) never compute inf - inf.
NEG_INIT = tl.constexpr(-1.0e30)
FP8_MAX = tl.constexpr(448.0)  # largest finite float8 e4m3fn


@triton.jit
def _attend_tile(q, k_cache_ptr, v_cache_ptr, kv_off, kv_mask, score_mask, m, l_sum, acc, qk_scale,
                 DOT_PRECISION: tl.constexpr):
    """One key/value tile of an online softmax: scores (log2 domain, `score_mask` false -> -inf), then the
    running maximum `m`, sum `l_sum` and accumulator `acc` updated; returns the three. Cached keys and
    values are read in the query's dtype (a no-op unless the cache is fp8; its scales are applied by the
    callers)."""
    k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(score_mask, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_sum = l_sum * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_sum, acc


@triton.jit
def _store_kv(cache_ptr, x, mask, inv_scale, QUANTIZED: tl.constexpr):
    """Store keys or values into the cache; QUANTIZED (an fp8 cache): value / scale, saturated to e4m3."""
    if QUANTIZED:
        x = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -FP8_MAX), FP8_MAX)
    tl.store(cache_ptr, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _slot_rows(slot_ptr, token, stride_cb, stride_ch, stride_ct,
               NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, KVH_PAD: tl.constexpr):
    """Offsets [KVH_PAD, 1] of the token's cache rows (one per KV head), and which of them to write: all
    real heads unless the slot is negative (padding)."""
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, KVH_PAD)[:, None]
    # (the slot test broadcast to a tensor first: the interpreter rejects scalar & tensor masks)
    keep = (heads < NUM_KV_HEADS) & (tl.zeros([KVH_PAD, 1], dtype=tl.int64) + slot >= 0)
    return (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + heads * stride_ch, keep


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ch, stride_ct, inv_k_scale, inv_v_scale,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KVH_PAD: tl.constexpr, D_PAD: tl.constexpr, QUANTIZED: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per token: copies its [kv_heads, head_dim] keys and values into slot
    `slot_mapping[token]`; a negative slot (padding) writes nothing."""
    pdl.wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    rows, keep = _slot_rows(slot_ptr, token, stride_cb, stride_ch, stride_ct, NUM_KV_HEADS, BLOCK_SIZE, KVH_PAD)
    heads = tl.arange(0, KVH_PAD)[:, None]
    dims = tl.arange(0, D_PAD)[None, :]
    mask = keep & (dims < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    _store_kv(k_cache_ptr + rows + dims, k, mask, inv_k_scale, QUANTIZED)
    _store_kv(v_cache_ptr + rows + dims, v, mask, inv_v_scale, QUANTIZED)


@triton.jit
def rotary_write_kv_kernel(
    positions_ptr, q_ptr, key_ptr, value_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_rope,
    stride_cb, stride_ch, stride_ct, inv_k_scale, inv_v_scale,
    NUM_Q_HEADS: tl.constexpr, Q_HEADS_PAD: tl.constexpr, NUM_KV_HEADS: tl.constexpr, KVH_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, QUANTIZED: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per token: `rotary_kernel` and `write_kv_kernel` in one launch. q is rotated in place;
    the rotated keys go straight to the cache (nothing else reads them), with the values."""
    pdl.wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    dtype = q_ptr.dtype.element_ty
    cos, sin = rotary_cos_sin(positions_ptr, token, cos_ptr, sin_ptr, stride_rope, dtype, HALF, HALF_PAD)
    q_row = q_ptr + token * stride_qt
    rotate_heads(q_row, q_row, stride_qh, stride_qh, cos, sin, NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD)
    k1, k2 = rotated_halves(key_ptr + token * stride_kt, stride_kh, cos, sin, dtype, NUM_KV_HEADS, KVH_PAD,
                            HALF, HALF_PAD)
    rows, keep = _slot_rows(slot_ptr, token, stride_cb, stride_ch, stride_ct, NUM_KV_HEADS, BLOCK_SIZE, KVH_PAD)
    half_dims = tl.arange(0, HALF_PAD)[None, :]
    half_mask = keep & (half_dims < HALF)
    _store_kv(k_cache_ptr + rows + half_dims, k1, half_mask, inv_k_scale, QUANTIZED)
    _store_kv(k_cache_ptr + rows + HALF + half_dims, k2, half_mask, inv_k_scale, QUANTIZED)
    heads = tl.arange(0, KVH_PAD)[:, None]
    dims = tl.arange(0, D_PAD)[None, :]
    mask = keep & (dims < HEAD_DIM)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    _store_kv(v_cache_ptr + rows + dims, v, mask, inv_v_scale, QUANTIZED)


@triton.jit
def _rotated_group(q_row, stride_qh, cos, sin, dtype: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   HALF: tl.constexpr):
    """The GROUP query heads at q_row, rotated as `rotate_heads` would store them: [GROUP_PAD, 2 * HALF] (HALF a
    power of two, so the two rotated halves side by side are the head)."""
    out1, out2 = rotated_halves(q_row, stride_qh, cos, sin, dtype, GROUP, GROUP_PAD, HALF, HALF)
    return tl.reshape(tl.permute(tl.join(out1, out2), (0, 2, 1)), (GROUP_PAD, 2 * HALF))


@triton.jit
def _write_new_token(key_row, value_row, k_rows, v_rows, cos, sin, inv_k_scale, inv_v_scale, keep,
                     dtype: tl.constexpr, HALF: tl.constexpr, QUANTIZED: tl.constexpr):
    """`rotary_write_kv_kernel`'s work for one KV head of one token: its key rotated and its value, stored at
    the cache rows k_rows and v_rows where `keep` ([1, 1]) says so."""
    k1, k2 = rotated_halves(key_row, 0, cos, sin, dtype, 1, 1, HALF, HALF)
    half_dims = tl.arange(0, HALF)[None, :]
    _store_kv(k_rows + half_dims, k1, keep, inv_k_scale, QUANTIZED)
    _store_kv(k_rows + HALF + half_dims, k2, keep, inv_k_scale, QUANTIZED)
    dims = tl.arange(0, 2 * HALF)[None, :]
    _store_kv(v_rows + dims, tl.load(value_row + dims, mask=keep, other=0.0), keep, inv_v_scale, QUANTIZED)


@triton.jit
def decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    qk_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ch, stride_ct, stride_bt,
    positions_ptr, key_ptr, value_ptr, cos_ptr, sin_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_rope, inv_k_scale, inv_v_scale,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr, D_PAD: tl.constexpr, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ROTARY: tl.constexpr, QUANTIZED: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (decodes, kv_heads, splits). Each sequence's context is cut into NUM_SPLITS equal runs of
    whole tiles, sized from its own length (so a grid sized for an upper bound, as a CUDA graph's is,
    still spreads a short context over several programs instead of leaving it to the first); the
    program for split s attends the GROUP query heads of KV head h over run s. With one split it writes
    the normalised output; otherwise it writes its unnormalised accumulator and softmax statistics
    (running max m, sum l_sum) for `merge_splits_kernel`. A split that starts past the sequence's
    length runs no iteration and leaves the neutral partial (m = NEG_INIT, l_sum = 0, acc = 0).

    With ROTARY (HEAD_DIM a power of two), the step's new token is not in the cache yet and q is not rotated:
    every program rotates its query heads as it loads them, and the program whose run holds the new position
    rotates that token's key and stores it and its value in the cache (`rotary_write_kv_kernel`'s work, a
    launch saved), then reads them back with the rest of its run. No other program reads that position."""
    pdl.wait_for_inputs(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    q_row = q_ptr + seq.to(tl.int64) * stride_qt
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE_N) * TILE_N
    split_start = split * tokens_per_split
    split_end = tl.minimum(split_start + tokens_per_split, seq_len)
    if ROTARY:
        dtype = q_ptr.dtype.element_ty
        cos, sin = rotary_cos_sin(positions_ptr, seq, cos_ptr, sin_ptr, stride_rope, dtype, HEAD_DIM // 2,
                                  HEAD_DIM // 2)
        q = _rotated_group(q_row + (kv_head * GROUP).to(tl.int64) * stride_qh, stride_qh, cos, sin, dtype, GROUP,
                           GROUP_PAD, HEAD_DIM // 2)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        owns_new = (split_start < seq_len) & (seq_len <= split_end) & (slot >= 0)
        cache_row = ((slot // BLOCK_SIZE) * stride_cb + kv_head.to(tl.int64) * stride_ch
                     + (slot % BLOCK_SIZE) * stride_ct)
        keep = (tl.zeros([1, 1], dtype=tl.int32) + owns_new.to(tl.int32)) != 0  # a tensor: the interpreter wants one
        _write_new_token(key_ptr + seq.to(tl.int64) * stride_kt + kv_head * stride_kh,
                         value_ptr + seq.to(tl.int64) * stride_vt + kv_head * stride_vh,
                         k_cache_ptr + cache_row, v_cache_ptr + cache_row, cos, sin, inv_k_scale, inv_v_scale, keep,
                         dtype, HEAD_DIM // 2, QUANTIZED)
        tl.debug_barrier()  # the new key and value stored before any thread of this program reads them back
    else:
        q = tl.load(q_row + heads[:, None] * stride_qh + dims[None, :],
                    mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    m = tl.full([GROUP_PAD], NEG_INIT, dtype=tl.float32)
    l_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)

    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_base = kv_head.to(tl.int64) * stride_ch
    for start in range(split_start, split_end, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        pos_mask = pos < split_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
        kv_off = block[:, None] * stride_cb + head_base + (pos % BLOCK_SIZE)[:, None] * stride_ct + dims[None, :]
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        m, l_sum, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, kv_off, kv_mask, pos_mask[None, :],
                                     m, l_sum, acc, qk_scale, DOT_PRECISION)

    out_mask = row_mask[:, None] & dim_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc * v_scale / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partials: [decodes, heads, splits] for m and l_sum, [decodes, heads, splits, D_PAD] for acc
        stat = (seq.to(tl.int64) * NUM_KV_HEADS * GROUP + heads) * NUM_SPLITS + split
        tl.store(part_m_ptr + stat, m, mask=row_mask)
        tl.store(part_l_ptr + stat, l_sum, mask=row_mask)
        tl.store(part_acc_ptr + stat[:, None] * D_PAD + dims[None, :], acc, mask=row_mask[:, None])


@triton.jit
def merge_splits_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, v_scale,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (decodes, heads): the log-sum-exp merge of one head's split partials. Neutral splits
    (l_sum = 0) weigh nothing; a row with no key at all (length 0, padding) comes out as zeros."""
    pdl.wait_for_inputs(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, D_PAD)
    split_mask = splits < NUM_SPLITS
    stat = (seq.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + splits
    m = tl.load(part_m_ptr + stat, mask=split_mask, other=NEG_INIT)
    l_sum = tl.load(part_l_ptr + stat, mask=split_mask, other=0.0)
    acc = tl.load(part_acc_ptr + stat[:, None] * D_PAD + dims[None, :], mask=split_mask[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    weight = tl.exp2(m - m_max)
    total = tl.sum(l_sum * weight, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0) * v_scale / tl.where(total > 0, total, 1.0)
    o_ptrs = out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + dims
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@triton.jit
def prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, tiles_ptr,
    out_ptr, qk_scale, v_scale, num_tiles,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ch, stride_ct, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """Grid (query tiles, kv_heads). A tile is BLOCK_Q consecutive query tokens of one sequence
    (`tiles_ptr` holds [sequence, first token within its chunk] per tile); its rows are those tokens
    times the GROUP query heads of one KV head. The chunk's n tokens are the last n positions of a
    context of seq_len tokens, all already in the cache; each row attends causally, flash-attention
    style: key tiles of TILE_N positions, online softmax, no score matrix kept."""
    pdl.wait_for_inputs(PDL)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tiles_ptr + tile)
    q_first = tl.load(tiles_ptr + num_tiles + tile)
    seq_len = tl.load(seq_lens_ptr + seq)
    q_begin = tl.load(query_start_ptr + seq)
    num_q = tl.load(query_start_ptr + seq + 1) - q_begin
    context_start = seq_len - num_q  # position of the chunk's first token

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    dims = tl.arange(0, D_PAD)
    q_idx = q_first + rows // GROUP_PAD  # token index within the chunk
    g = rows % GROUP_PAD
    row_mask = (q_idx < num_q) & (g < GROUP)
    dim_mask = dims < HEAD_DIM
    heads = kv_head * GROUP + g
    q_pos = context_start + q_idx
    tokens = (q_begin + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :], other=0.0,
    )

    m = tl.full([BLOCK_Q * GROUP_PAD], NEG_INIT, dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_Q * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, D_PAD], dtype=tl.float32)

    # keys up to the tile's last query position (causal), within the context
    kv_end = tl.minimum(seq_len, context_start + tl.minimum(q_first + BLOCK_Q, num_q))
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_base = kv_head.to(tl.int64) * stride_ch
    for start in range(0, kv_end, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        pos_mask = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
        kv_off = block[:, None] * stride_cb + head_base + (pos % BLOCK_SIZE)[:, None] * stride_ct + dims[None, :]
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        causal = pos_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        m, l_sum, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, kv_off, kv_mask, causal,
                                     m, l_sum, acc, qk_scale, DOT_PRECISION)

    out = acc * v_scale / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    o_ptrs = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])
