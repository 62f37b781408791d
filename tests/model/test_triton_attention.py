"""The Triton attention backend against the torch reference on random paged caches: decodes (one and
several splits), fresh prompts, chunks continuing a cached context, mixed batches, the KV write (slot -1
skipped), and the tiny model's greedy outputs. Without CUDA the kernels run in Triton's interpreter on
CPU in float32; with CUDA the `gpu` class runs them natively in bfloat16."""

from __future__ import annotations

import os
import textwrap

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels module imports triton

import pytest  # noqa: E402

pytest.importorskip("triton")

from llmserve.model import layers  # noqa: E402
from llmserve.model.attention.base import AttentionMetadata  # noqa: E402
from llmserve.model.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from llmserve.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from llmserve.model.config import RopeConfig  # noqa: E402
from tests.model.triton_aot import assert_compiles_for_sm90  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _batch(decode_lens, prefills, heads, kv_heads, head_dim, block_size, dtype, seed, device=DEVICE):
    """A random step: decodes (context lengths, new token last), then prefill chunks (context, new
    tokens). Each sequence owns shuffled, non-contiguous blocks; tables are padded with 0.
    Returns (query, key, value, k_cache, v_cache, meta factory)."""
    gen = torch.Generator().manual_seed(seed)
    specs = [(n, 1) for n in decode_lens] + list(prefills)
    blocks_needed = [-(-ctx // block_size) for ctx, _ in specs]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, starts, used = [], [], [0], 0
    for (ctx, new), need in zip(specs, blocks_needed, strict=True):
        table = perm[used : used + need]
        used += need
        tables.append(table)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(ctx - new, ctx))
        starts.append(starts[-1] + new)
    width = max(blocks_needed)
    padded = [t + [0] * (width - len(t)) for t in tables]
    tokens = starts[-1]
    shape = (num_blocks, kv_heads, block_size, head_dim)

    def rand(*size):
        return torch.randn(*size, generator=gen).to(dtype).to(device)

    k_cache, v_cache = rand(*shape), rand(*shape)
    query = rand(tokens, heads, head_dim)
    key, value = rand(tokens, kv_heads, head_dim), rand(tokens, kv_heads, head_dim)
    lens = [ctx for ctx, _ in specs]

    def meta(max_seq_len=None):
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            num_decodes=len(decode_lens),
            num_decode_tokens=len(decode_lens),
            max_seq_len=max_seq_len or max(lens),
            query_start_loc_host=starts,
            seq_lens_host=lens,
        )

    return query, key, value, k_cache, v_cache, meta


def _backend(heads, kv_heads, head_dim, block_size, dtype, many_splits=False):
    backend = TritonAttentionBackend(heads, kv_heads, head_dim, block_size, dtype)
    if many_splits:  # short splits and a large program target: several splits even for short contexts
        backend.decode_tile = 16
        backend.min_split_tokens = 16
        backend._target_programs = 1 << 20
    return backend


def _compare(heads, kv_heads, head_dim, block_size, decode_lens, prefills, dtype=torch.float32, tol=2e-4,
             many_splits=False, seed=0, max_seq_len=None):
    query, key, value, k_cache, v_cache, meta = _batch(
        decode_lens, prefills, heads, kv_heads, head_dim, block_size, dtype, seed
    )
    # reference in float32 on the host
    reference = TorchAttentionBackend(heads, kv_heads, head_dim, block_size, torch.float32)
    ref_meta = meta()
    ref_meta = AttentionMetadata(**{**ref_meta.__dict__, **{
        f: getattr(ref_meta, f).cpu() for f in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")
    }, "backend_data": {}})
    ref_k, ref_v = k_cache.float().cpu(), v_cache.float().cpu()
    reference.prepare(ref_meta)
    expected = reference.forward(query.float().cpu(), key.float().cpu(), value.float().cpu(), ref_k, ref_v, ref_meta)

    backend = _backend(heads, kv_heads, head_dim, block_size, dtype, many_splits)
    step = meta(max_seq_len)
    backend.prepare(step)
    out = backend.forward(query, key, value, k_cache, v_cache, step)
    assert out.dtype == query.dtype and out.shape == query.shape
    torch.testing.assert_close(k_cache.float().cpu(), ref_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache.float().cpu(), ref_v, atol=0, rtol=0)
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)
    return step


DECODES = [1, 16, 17, 45, 64, 100]  # one token, exact blocks, partial blocks, several splits
FRESH = [(1, 1), (16, 16), (37, 37)]  # whole prompts (context == new tokens)
CHUNKS = [(50, 10), (64, 32), (33, 1)]  # chunks continuing a cached context
SHAPES = [(2, 2, 64, 16), (4, 1, 128, 32), (8, 1, 64, 16), (8, 2, 128, 16)]  # GQA 1, 4, 8, 4


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
@pytest.mark.parametrize("many_splits", [False, True])
def test_decode_matches_the_reference(heads, kv_heads, head_dim, block_size, many_splits):
    step = _compare(heads, kv_heads, head_dim, block_size, DECODES, [], many_splits=many_splits)
    assert (step.backend_data["triton_splits"] > 1) == many_splits


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
def test_prefill_fresh_prompts_and_chunks_match_the_reference(heads, kv_heads, head_dim, block_size):
    _compare(heads, kv_heads, head_dim, block_size, [], FRESH + CHUNKS, seed=1)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES[:2])
def test_mixed_batch_matches_the_reference(heads, kv_heads, head_dim, block_size):
    _compare(heads, kv_heads, head_dim, block_size, [3, 40], [(20, 20), (70, 6)], many_splits=True, seed=2)


def test_long_query_chunk_spans_several_query_tiles():
    # 8 query heads per kv head: 8 tokens per 64-row tile, so a 40-token chunk takes 5 tiles
    _compare(8, 1, 64, 16, [], [(90, 40), (40, 40)], seed=3)


def test_decode_grid_sized_for_a_longer_bound_gives_the_same_result():
    # what a CUDA graph captured at max_model_len sees: most splits lie past every sequence's end
    step = _compare(4, 2, 64, 16, [5, 33, 60], [], many_splits=True, seed=4, max_seq_len=400)
    assert step.backend_data["triton_splits"] >= 20


def test_non_power_of_two_head_dim():
    _compare(4, 2, 80, 16, [7, 50], [(30, 12)], seed=5)


def test_write_kv_stores_each_slot_and_skips_minus_one():
    heads, kv_heads, head_dim, block_size = 4, 2, 64, 16
    query, key, value, k_cache, v_cache, meta = _batch([], [(40, 40)], heads, kv_heads, head_dim, block_size,
                                                       torch.float32, seed=6)
    step = meta()
    step.slot_mapping[::3] = -1  # padding tokens
    k_before, v_before = k_cache.clone(), v_cache.clone()
    backend = _backend(heads, kv_heads, head_dim, block_size, torch.float32)
    backend.write_kv(key, value, k_cache, v_cache, step)
    expected_k, expected_v = k_before.clone(), v_before.clone()
    for token, slot in enumerate(step.slot_mapping.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, :, slot % block_size] = key[token]
            expected_v[slot // block_size, :, slot % block_size] = value[token]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert not torch.equal(k_cache, k_before)


def test_write_kv_reads_strided_views():
    # the model passes k and v as views into one fused qkv projection
    heads, kv_heads, head_dim, block_size = 4, 2, 64, 16
    _, _, _, k_cache, v_cache, meta = _batch([], [(20, 20)], heads, kv_heads, head_dim, block_size, torch.float32, 7)
    fused = torch.randn(20, (heads + 2 * kv_heads) * head_dim, device=DEVICE)
    _, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k, v = k.view(20, kv_heads, head_dim), v.view(20, kv_heads, head_dim)
    step = meta()
    _backend(heads, kv_heads, head_dim, block_size, torch.float32).write_kv(k, v, k_cache, v_cache, step)
    slots = step.slot_mapping.long()
    assert torch.equal(k_cache[slots // block_size, :, slots % block_size], k)
    assert torch.equal(v_cache[slots // block_size, :, slots % block_size], v)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [(2, 2, 64, 16), (4, 1, 128, 32), (4, 2, 80, 16)])
@pytest.mark.parametrize("fp8_cache", [False, True])
def test_rotary_inside_the_kv_write_equals_rotary_then_the_write(
    monkeypatch, heads, kv_heads, head_dim, block_size, fp8_cache
):
    """The fused launch (the model's Triton rotary kernel would run) against the Triton rotary followed by
    the KV write: the same rotated queries, cache bits and attention output; a padding token (slot -1)
    still has its query rotated and writes nothing."""
    monkeypatch.setattr(layers, "use_fused_kernels", True)  # the Triton rotary, in the interpreter too
    dtype = torch.bfloat16 if CUDA else torch.float32
    query, key, value, k_cache, v_cache, meta = _batch([5, 40], [(30, 12)], heads, kv_heads, head_dim, block_size,
                                                       dtype, seed=6)
    step = meta()
    skipped = divmod(step.slot_mapping[1].item(), block_size)  # (block, offset) the padding token would write
    step.slot_mapping[1] = -1
    lens = step.seq_lens_host
    positions = torch.tensor([lens[0] - 1, lens[1] - 1, *range(lens[2] - 12, lens[2])], device=DEVICE)
    rotary = layers.RotaryEmbedding(head_dim, 64, RopeConfig()).to(DEVICE)
    cache_dtype = torch.float8_e4m3fn if fp8_cache else None
    results = []
    for fused in (False, True):
        backend = TritonAttentionBackend(heads, kv_heads, head_dim, block_size, dtype, cache_dtype)
        backend.k_scale, backend.v_scale = (0.5, 0.25) if fp8_cache else (1.0, 1.0)
        if not fused:
            backend.fused_kernels = None  # the model's path before: rotary(positions, q, k), then write_kv
        before = [c.clone() if cache_dtype is None else c.to(cache_dtype) for c in (k_cache, v_cache)]
        caches = [c.clone() for c in before]
        q = query.clone()
        step.backend_data = {}
        backend.prepare(step)
        out = backend.forward(q, key.clone(), value.clone(), *caches, step, rotary, positions)
        results.append((q, out, *(c.view(torch.uint8) if fp8_cache else c for c in caches)))
    for unfused, fused in zip(*results, strict=True):
        assert torch.equal(unfused, fused)
    assert not torch.equal(results[0][0], query)  # the queries were rotated in place
    block, offset = skipped
    for cache, untouched in zip(results[1][2:], before, strict=True):
        assert torch.equal(cache[block, :, offset], untouched.view(cache.dtype)[block, :, offset])


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [(4, 1, 128, 32), (8, 2, 32, 16)])
@pytest.mark.parametrize("fp8_cache", [False, True])
@pytest.mark.parametrize("many_splits", [False, True])
def test_rotary_inside_the_decode_launch_equals_the_rotary_kv_write_then_attention(
    monkeypatch, heads, kv_heads, head_dim, block_size, fp8_cache, many_splits
):
    """LLMSERVE_FOLD_ROTARY: a decode-only step rotates and writes its new tokens inside the decode launch, with
    the same cache bits and attention output as the rotary + KV write launch before it, with one split or many
    (the new position in the last); a padding token (slot -1) writes nothing either way."""
    from llmserve.model.attention import triton_backend

    monkeypatch.setattr(layers, "use_fused_kernels", True)
    dtype = torch.bfloat16 if CUDA else torch.float32
    query, key, value, k_cache, v_cache, meta = _batch([5, 40, 17, 64], [], heads, kv_heads, head_dim, block_size,
                                                       dtype, seed=8)
    step = meta()
    step.slot_mapping[2] = -1
    positions = torch.tensor([n - 1 for n in step.seq_lens_host], device=DEVICE)
    rotary = layers.RotaryEmbedding(head_dim, 64, RopeConfig()).to(DEVICE)
    cache_dtype = torch.float8_e4m3fn if fp8_cache else None
    results = []
    for fold in (False, True):
        monkeypatch.setattr(triton_backend, "fold_rotary", fold)
        backend = _backend(heads, kv_heads, head_dim, block_size, dtype, many_splits)
        backend.kv_cache_dtype = cache_dtype or dtype
        backend.k_scale, backend.v_scale = (0.5, 0.25) if fp8_cache else (1.0, 1.0)
        assert backend._rotary_in_decode is fold
        caches = [c.clone() if cache_dtype is None else c.to(cache_dtype) for c in (k_cache, v_cache)]
        step.backend_data = {}
        backend.prepare(step)
        assert (step.backend_data["triton_splits"] > 1) is many_splits
        out = backend.forward(query.clone(), key.clone(), value.clone(), *caches, step, rotary, positions)
        results.append((out, *(c.view(torch.uint8) if fp8_cache else c for c in caches)))
    for unfolded, folded in zip(*results, strict=True):
        assert torch.equal(unfolded, folded)


def test_rotary_stays_in_its_own_launch_for_prefills_and_odd_head_sizes(monkeypatch):
    from llmserve.model.attention import triton_backend

    monkeypatch.setattr(triton_backend, "fold_rotary", True)
    assert TritonAttentionBackend(4, 2, 128, 16)._rotary_in_decode
    assert not TritonAttentionBackend(4, 2, 80, 16)._rotary_in_decode and not TritonAttentionBackend(4, 2, 8, 16)._rotary_in_decode
    monkeypatch.setattr(layers, "use_fused_kernels", True)
    launches = []
    backend = TritonAttentionBackend(2, 2, 64, 16)
    monkeypatch.setattr(backend, "_rotate_and_write_kv", lambda *args: launches.append("rotary + KV write"))
    monkeypatch.setattr(backend, "attend", lambda *args: launches.append("attend" if len(args) == 4 else "folded"))
    rotary = layers.RotaryEmbedding(64, 64, RopeConfig()).to(DEVICE)
    for decodes, prefills in (([5], [(30, 12)]), ([5, 9], [])):
        query, key, value, k_cache, v_cache, meta = _batch(decodes, prefills, 2, 2, 64, 16, torch.float32, seed=9)
        step = meta()
        backend.forward(query, key, value, k_cache, v_cache, step, rotary, torch.zeros(len(step.slot_mapping),
                                                                                      dtype=torch.long, device=DEVICE))
    assert launches == ["rotary + KV write", "attend", "folded"]


@pytest.mark.skipif(CUDA, reason="the error is for machines without CUDA")
def test_without_cuda_or_interpreter_construction_says_so(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU.*TRITON_INTERPRET=1"):
        TritonAttentionBackend(4, 2, 64, 16)


# Compiles every kernel for an sm_90 GPU without one (Triton's bundled ptxas), in a process without
# TRITON_INTERPRET: the interpreter accepts code that the compiler rejects (non-constexpr globals, dot
# shapes below 16). Strides and pointers carry the divisibility the JIT would infer at launch.
_AOT = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from llmserve.model.attention import triton_kernels as K
    from tests.model.triton_aot import assert_pdl_order

    def build(fn, dtype, consts, **kwargs):
        compiled = compile_one(fn, dtype, {**consts, "PDL": True}, **kwargs)
        assert_pdl_order(compiled.asm["ptx"], True, fn.__name__)
        if without_pdl:  # the same code less its two PDL instructions: each kernel's first variant suffices
            assert_pdl_order(compile_one(fn, dtype, {**consts, "PDL": False}, **kwargs).asm["ptx"], False, fn.__name__)
        return compiled

    def compile_one(fn, dtype, consts, floats=("qk_scale", "v_scale", "inv_k_scale", "inv_v_scale"), fp32_ptrs=(),
                    cache_dtype=None, options=None):
        sig, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in consts:
                sig[name] = "constexpr"
                continue
            if name.endswith("_ptr"):
                int_ptr = name in ("block_tables_ptr", "seq_lens_ptr", "query_start_ptr", "tiles_ptr")
                cache_ptr = name in ("k_cache_ptr", "v_cache_ptr")
                sig[name] = "*i32" if int_ptr else "*i64" if name in ("slot_ptr", "positions_ptr") else (
                    "*fp32" if name in fp32_ptrs else "*" + (cache_dtype or dtype if cache_ptr else dtype))
            else:
                sig[name] = "fp32" if name in floats else "i32"
            if name.endswith("_ptr") or name.startswith("stride_"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                              options=options or {})

    # (activations, KV cache): the model dtype's cache, and an fp8 cache under bf16 activations
    for dtype, precision, cache in (("bf16", "tf32", None), ("fp32", "ieee", None), ("bf16", "tf32", "fp8e4nv")):
        without_pdl = dtype == "bf16" and cache is None
        shape = dict(HEAD_DIM=128, BLOCK_SIZE=16, D_PAD=128)
        build(K.write_kv_kernel, dtype, dict(NUM_KV_HEADS=2, KVH_PAD=2, QUANTIZED=cache is not None, **shape),
              cache_dtype=cache)
        rotary = build(K.rotary_write_kv_kernel, dtype, dict(NUM_Q_HEADS=8, Q_HEADS_PAD=8, NUM_KV_HEADS=2, KVH_PAD=2,
                                                             HALF=64, HALF_PAD=64, QUANTIZED=cache is not None,
                                                             **shape),
                       fp32_ptrs=("cos_ptr", "sin_ptr"), cache_dtype=cache, options={"enable_fp_fusion": False})
        # no 16-bit multiply-add: the rotation rounds each product as the torch code stores it
        assert not [line for line in rotary.asm["ptx"].splitlines() if "fma." in line and "f16" in line]
        for splits, rotary in ((1, False), (4, False), (1, True), (4, True)):
            parts = ("part_acc_ptr", "part_m_ptr", "part_l_ptr") if splits > 1 else ()
            decode = build(K.decode_kernel, dtype, dict(NUM_KV_HEADS=2, GROUP=4, GROUP_PAD=16, TILE_N=64,
                                                        NUM_SPLITS=splits, DOT_PRECISION=precision, ROTARY=rotary,
                                                        QUANTIZED=cache is not None, **shape),
                           fp32_ptrs=(*parts, "cos_ptr", "sin_ptr"), cache_dtype=cache,
                           options={"enable_fp_fusion": False})
            assert not [line for line in decode.asm["ptx"].splitlines() if "fma." in line and "f16" in line]
        build(K.merge_splits_kernel, dtype, dict(NUM_HEADS=8, HEAD_DIM=128, D_PAD=128, NUM_SPLITS=5, SPLITS_PAD=8),
              fp32_ptrs=("part_acc_ptr", "part_m_ptr", "part_l_ptr"))
        build(K.prefill_kernel, dtype, dict(GROUP=4, GROUP_PAD=4, BLOCK_Q=16, TILE_N=64, DOT_PRECISION=precision,
                                            **shape), cache_dtype=cache)
    print("compiled")
""")


def test_kernels_compile_for_a_cuda_gpu():
    assert_compiles_for_sm90(_AOT)


def test_backend_is_registered():
    from llmserve.model.attention import get_backend

    assert get_backend("triton") is TritonAttentionBackend


def test_tiny_model_greedy_outputs_match_the_torch_backend(tiny_llama_dir):
    """The Triton backend's tokens are the torch backend's (with every fold on: test_triton_linear.py)."""
    from llmserve import LLM, SamplingParams

    prompts = ["The quick brown fox", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    args = dict(dtype="float32", num_kv_blocks=16, max_model_len=128, max_num_batched_tokens=8)  # chunked
    expected = LLM(str(tiny_llama_dir), attention_backend="torch", **args).generate(prompts, params)
    got = LLM(str(tiny_llama_dir), attention_backend="triton", **args).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]


def test_speculative_drafts_verified_by_the_decode_kernel_give_plain_decodings_tokens(cycling_llama_dir):
    """A draft's row is a decode at its position: the Triton decode kernel reads the KV the rows before it wrote
    in the same step (no row writes its own in its attention launch while speculating)."""
    from llmserve import LLM, SamplingParams

    prompts = ["The quick brown fox", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    args = dict(dtype="float32", num_kv_blocks=16, max_model_len=128)
    expected = LLM(str(cycling_llama_dir), attention_backend="torch", **args).generate(prompts, params)
    speculating = LLM(str(cycling_llama_dir), attention_backend="triton", **args,
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    got = speculating.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert speculating.engine.core.stats().spec_decode.num_accepted_tokens > 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
class TestNativeBfloat16:
    TOL = 2e-2

    @pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
    @pytest.mark.parametrize("many_splits", [False, True])
    def test_decode(self, heads, kv_heads, head_dim, block_size, many_splits):
        _compare(heads, kv_heads, head_dim, block_size, DECODES + [1000, 3000], [], torch.bfloat16, self.TOL,
                 many_splits)

    @pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
    def test_prefill_and_mixed(self, heads, kv_heads, head_dim, block_size):
        _compare(heads, kv_heads, head_dim, block_size, [], FRESH + CHUNKS + [(700, 300), (513, 513)],
                 torch.bfloat16, self.TOL, seed=1)
        _compare(heads, kv_heads, head_dim, block_size, [3, 40, 2000], [(20, 20), (700, 60)], torch.bfloat16,
                 self.TOL, seed=2)

    def test_long_context_split_decode(self):
        # one long sequence, small batch: the case splits are for (default split policy)
        step = _compare(32, 8, 128, 16, [30000, 17], [], torch.bfloat16, self.TOL, seed=3)
        assert step.backend_data["triton_splits"] > 1

    def test_decode_in_a_cuda_graph(self):
        heads, kv_heads, head_dim, block_size = 8, 2, 128, 16
        query, key, value, k_cache, v_cache, meta = _batch([10, 200, 1000], [], heads, kv_heads, head_dim,
                                                           block_size, torch.bfloat16, seed=4)
        backend = _backend(heads, kv_heads, head_dim, block_size, torch.bfloat16)
        step = meta(max_seq_len=4096)  # capture at the upper bound
        backend.prepare(step)
        eager = backend.forward(query, key, value, k_cache.clone(), v_cache.clone(), step)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (compile) outside the capture
            backend.forward(query, key, value, k_cache, v_cache, step)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = backend.forward(query, key, value, k_cache, v_cache, step)
        graph.replay()
        torch.testing.assert_close(out, eager, atol=0, rtol=0)
        # other lengths, same graph: equal to an eager run over the same caches and lengths
        step.seq_lens.copy_(torch.tensor([11, 150, 900], device="cuda", dtype=torch.int32))
        graph.replay()
        eager = backend.forward(query, key, value, k_cache.clone(), v_cache.clone(), step)
        torch.testing.assert_close(out, eager, atol=0, rtol=0)


# ---- fp8 KV cache -------------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.5, 0.25


def _e4m3_representable(t: torch.Tensor, scale: float) -> torch.Tensor:
    # Triton 3.9's interpreter rounds float32 -> e4m3 wrongly when the mantissa carries into the exponent
    # (1.97 becomes 1.0), so the new keys and values are values e4m3 holds exactly: the write's scaling,
    # saturation and layout are what is checked here; on CUDA the hardware converts.
    return (t.float() / scale).to(FP8).float().mul(scale).to(t.dtype)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES[:3])
@pytest.mark.parametrize("many_splits", [False, True])
def test_fp8_kv_cache_matches_the_reference_on_its_dequantized_values(heads, kv_heads, head_dim, block_size, many_splits):
    dtype = torch.bfloat16 if CUDA else torch.float32
    query, key, value, k_cache, v_cache, meta = _batch(
        [1, 17, 45], [(16, 16), (50, 10)], heads, kv_heads, head_dim, block_size, dtype, seed=3
    )
    key, value = _e4m3_representable(key, K_SCALE), _e4m3_representable(value, V_SCALE)
    key[0, 0, 0], value[-1, 0, 1] = 1000.0, -1000.0  # past e4m3's range once scaled: saturate at +-448
    k_fp8, v_fp8 = (k_cache.float() / K_SCALE).to(FP8), (v_cache.float() / V_SCALE).to(FP8)
    # the reference: float32 attention over the dequantized cache and the new values as stored
    ref_k, ref_v = k_fp8.float() * K_SCALE, v_fp8.float() * V_SCALE
    ref_k, ref_v = ref_k.cpu(), ref_v.cpu()
    stored_key = key.float().clamp(-448 * K_SCALE, 448 * K_SCALE).cpu()
    stored_value = value.float().clamp(-448 * V_SCALE, 448 * V_SCALE).cpu()
    reference = TorchAttentionBackend(heads, kv_heads, head_dim, block_size, torch.float32)
    ref_meta = meta()
    ref_meta = AttentionMetadata(**{**ref_meta.__dict__, **{
        f: getattr(ref_meta, f).cpu() for f in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")
    }, "backend_data": {}})
    reference.prepare(ref_meta)
    expected = reference.forward(query.float().cpu(), stored_key, stored_value, ref_k, ref_v, ref_meta)

    backend = TritonAttentionBackend(heads, kv_heads, head_dim, block_size, dtype, kv_cache_dtype=FP8)
    if many_splits:
        backend.decode_tile, backend.min_split_tokens, backend._target_programs = 16, 16, 1 << 20
    backend.k_scale, backend.v_scale = K_SCALE, V_SCALE
    step = meta()
    backend.prepare(step)
    out = backend.forward(query, key, value, k_fp8, v_fp8, step)
    torch.testing.assert_close(k_fp8.float().cpu() * K_SCALE, ref_k, atol=0, rtol=0)
    torch.testing.assert_close(v_fp8.float().cpu() * V_SCALE, ref_v, atol=0, rtol=0)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-4
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)


def test_fp8_kv_cache_doubles_the_tokens_of_a_bfloat16_cache(tiny_llama_dir):
    """The pool is sized by bytes per element: 1 for e4m3, 2 for bfloat16 (and 4 for float32); on CPU from
    kv_cache_memory, on a GPU from the memory left after a profiled step."""
    from llmserve.config import EngineConfig
    from llmserve.model.config import ModelConfig
    from llmserve.model.runner import ModelRunner

    def blocks(dtype: str, kv_cache_dtype: str) -> ModelRunner:
        config = EngineConfig(model=str(tiny_llama_dir), dtype=dtype, attention_backend="triton",
                              kv_cache_dtype=kv_cache_dtype, kv_cache_memory=1 << 20, device=DEVICE)
        runner = ModelRunner(config, ModelConfig.from_pretrained(tiny_llama_dir), tiny_llama_dir, max_model_len=64)
        assert runner.kv_caches[0][0].dtype == (FP8 if kv_cache_dtype == "fp8" else runner.dtype)
        return runner.num_blocks

    for dtype, ratio in (("bfloat16", 2), ("float32", 4)):
        fp8, full = blocks(dtype, "fp8"), blocks(dtype, "auto")
        if CUDA:  # the pool is what a profiled budget holds, and two profiles differ by a few MiB
            assert abs(fp8 / full - ratio) < 0.01 * ratio
        else:
            assert fp8 == ratio * full


def test_tiny_model_serves_with_an_fp8_kv_cache_without_leaking_blocks(tiny_llama_dir):
    from llmserve import LLM, SamplingParams

    llm = LLM(str(tiny_llama_dir), attention_backend="triton", kv_cache_dtype="fp8", dtype="float32",
              num_kv_blocks=32, max_model_len=256, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(["The quick brown fox", "def fibonacci(n):"], params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [6, 6]
    blocks = llm.engine.core.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks
