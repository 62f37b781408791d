"""The one-call CPU decoder (`cpu_decode`) against the per-module forward pass on the kernel path.

Both run the same kernels in the same order, so for decode steps the hidden states and the KV caches must
be the same bits, on each implementation of the kernels built here; a short prefill chunk, which the per-module
path attends with SDPA, agrees within bf16 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.model import cpu_decode, cpu_linear, cpu_lora, layers
from llmserve.model.attention import AttentionMetadata, TorchAttentionBackend, cpu_kernels, int8_kv
from llmserve.model.builtin import ensure_default_model
from llmserve.model.config import ModelConfig
from llmserve.model.layers import Linear
from llmserve.model.llama import LlamaForCausalLM
from llmserve.model.lora import LoRASlots
from llmserve.model.quantization.int8 import Int8LinearMethod, quantize_int8

pytestmark = pytest.mark.skipif(cpu_decode.load() is None, reason="the CPU decoder could not be built here")

BLOCK_SIZE = 16


@pytest.fixture(params=[*cpu_linear.fast_paths(), "portable"])
def path(request):
    """The linear kernels on each implementation built here, and the attention kernel on the path the step
    takes with it (AVX-512 beside the AVX-512 linears, plain C otherwise)."""
    cpu_linear.use_path(request.param)
    cpu_kernels.use_portable(request.param not in ("avx512_bf16", "avx512"))
    yield request.param
    cpu_linear.use_path("best")
    cpu_kernels.use_portable(False)


def _model(arch: str, head_dim: int = 32, seed: int = 0) -> LlamaForCausalLM:
    """A 3-layer bf16 model of `arch` ("llama"; "qwen2": q/k/v bias; "qwen3": per-head q/k norms) with random
    weights, norm weights included."""
    heads = 256 // head_dim
    cfg = ModelConfig.from_dict({
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]],
        "model_type": arch, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 704,
        "num_hidden_layers": 3, "num_attention_heads": heads, "num_key_value_heads": heads // 2, "head_dim": head_dim,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    })
    model = LlamaForCausalLM(cfg)
    model.init_dummy_weights(seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.copy_(1 + 0.3 * torch.randn(param.shape, generator=gen))
    return model.eval()


def _caches(model: LlamaForCausalLM, backend: TorchAttentionBackend, num_blocks: int, seed: int):
    """Random KV caches: the context the steps attend to."""
    gen = torch.Generator().manual_seed(seed)
    shape = backend.kv_cache_shape(num_blocks)
    return [(torch.randn(shape, generator=gen).to(torch.bfloat16), torch.randn(shape, generator=gen).to(torch.bfloat16))
            for _ in model.layers]


def _int8_caches(model: LlamaForCausalLM, backend: TorchAttentionBackend, num_blocks: int, seed: int):
    """Random int8 KV caches (`--kv-cache-dtype int8`): random bf16 rows in every slot, written as the backend
    writes new keys and values."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.arange(num_blocks * BLOCK_SIZE)
    blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    caches = []
    for _ in model.layers:
        pair = tuple(torch.zeros(backend.kv_cache_shape(num_blocks), dtype=torch.int8) for _ in range(2))
        for cache in pair:
            rows = torch.randn(len(slots), backend.num_kv_heads, backend.head_dim, generator=gen).to(torch.bfloat16)
            int8_kv.write(cache, blocks, offsets, rows)
        caches.append(pair)
    return caches


def _meta(seq_lens: list[int], num_new: list[int], tables: list[list[int]]) -> tuple[torch.Tensor, AttentionMetadata]:
    """Positions and metadata of a step where sequence i computes its last num_new[i] of seq_lens[i] tokens."""
    positions, slots, starts = [], [], [0]
    for length, new, table in zip(seq_lens, num_new, tables, strict=True):
        for pos in range(length - new, length):
            positions.append(pos)
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        starts.append(starts[-1] + new)
    width = max(map(len, tables))
    padded = [table + [0] * (width - len(table)) for table in tables]
    num_decodes = next((i for i, new in enumerate(num_new) if new != 1), len(num_new))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=torch.tensor(padded, dtype=torch.int32),
        num_decodes=num_decodes, num_decode_tokens=num_decodes, max_seq_len=max(seq_lens),
        query_start_loc_host=starts, seq_lens_host=seq_lens,
    )
    return torch.tensor(positions), meta


def _tables(lengths: list[int], num_blocks: int, seed: int) -> list[list[int]]:
    """Distinct shuffled blocks for each sequence, enough for its final length."""
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for length in lengths:
        need = -(-length // BLOCK_SIZE)
        tables.append(perm[used : used + need])
        used += need
    return tables


def _both_paths(model, backend, caches, input_ids, positions, meta, lora_slots=None):
    """(hidden, caches) of the per-module forward pass and of the one-call decoder, each on its own copy
    (`lora_slots`: each token's LoRA adapter slot, as the per-module path's `LoRASlots` has them)."""
    per_module = [(k.clone(), v.clone()) for k, v in caches]
    one_call = [(k.clone(), v.clone()) for k, v in caches]
    with torch.inference_mode():
        backend.prepare(meta)
        expected = model(input_ids, positions, per_module, backend, meta)
        decoder = cpu_decode.CpuDecoder.build(model, one_call, backend)
        assert decoder is not None and decoder.fits(len(input_ids))
        got = decoder(input_ids, positions, meta, lora_slots)
    return expected, per_module, got, one_call


def _assert_decode_steps_bit_equal(model, backend, caches, start_lens, tables, row_counts, steps: int, seed: int):
    """For each count of sequences, `steps` consecutive decode steps (each reading the keys the previous one
    wrote) give the same hidden states and caches on both paths."""
    gen = torch.Generator().manual_seed(seed)
    for rows in row_counts:
        for step in range(steps):
            lens = [n + step for n in start_lens[:rows]]
            positions, meta = _meta(lens, [1] * rows, tables[:rows])
            input_ids = torch.randint(0, model.config.vocab_size, (rows,), generator=gen)
            expected, expected_caches, got, got_caches = _both_paths(model, backend, caches, input_ids, positions, meta)
            assert torch.equal(got, expected), f"{rows} rows, step {step}: max diff {(got - expected).abs().max()}"
            for (k1, v1), (k2, v2) in zip(expected_caches, got_caches, strict=True):
                assert torch.equal(k1, k2) and torch.equal(v1, v2)
            caches = got_caches


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("arch", "head_dim"), [("llama", 32), ("llama", 64), ("qwen2", 32), ("qwen3", 64)])
def test_decode_steps_are_bit_equal_to_the_per_module_path(path, arch, head_dim, threads):
    torch.set_num_threads(threads)
    model = _model(arch, head_dim)
    cfg = model.config
    backend = TorchAttentionBackend(cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, BLOCK_SIZE,
                                    dtype=torch.bfloat16)
    num_blocks = 96
    caches = _caches(model, backend, num_blocks, seed=head_dim)
    # 1 to 8, 12 and 16 sequences (as many as the path's linear kernels take); lengths on both sides of block
    # boundaries, one token, many blocks
    start_lens = [1, 15, 16, 17, 31, 33, 100, 250, 2, 47, 48, 49, 64, 5, 80, 120]
    tables = _tables([n + 3 for n in start_lens], num_blocks, seed=len(arch))
    row_counts = [rows for rows in (*range(1, 9), 12, 16) if rows <= cpu_linear.max_rows()]
    _assert_decode_steps_bit_equal(model, backend, caches, start_lens, tables, row_counts, steps=3, seed=7)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("arch", "head_dim"), [("llama", 64), ("qwen3", 32)])
def test_int8_kv_cache_steps_are_bit_equal_to_the_per_module_path(path, arch, head_dim, threads):
    """With `--kv-cache-dtype int8` both paths quantize the new keys and values to the same bits (the torch
    backend's write, the C step's store_row) and read them with the same kernel."""
    torch.set_num_threads(threads)
    model = _model(arch, head_dim)
    cfg = model.config
    backend = TorchAttentionBackend(cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, BLOCK_SIZE,
                                    dtype=torch.bfloat16, kv_cache_dtype=torch.int8)
    caches = _int8_caches(model, backend, 48, seed=head_dim)
    start_lens = [1, 15, 16, 17, 31, 33, 100, 250]
    tables = _tables([n + 2 for n in start_lens], 48, seed=3)
    _assert_decode_steps_bit_equal(model, backend, caches, start_lens, tables, (1, 3, 8), steps=2, seed=9)


def _quantize_int8(model: LlamaForCausalLM) -> None:
    """The decoder's linear layers to int8 per-channel weights, as `--quantization int8` does at load."""
    for layer in model.layers.modules():
        if isinstance(layer, Linear):
            q, scale = quantize_int8(layer.weight)
            layer.weight = torch.nn.Parameter(q, requires_grad=False)
            layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
            layer.quant_method = Int8LinearMethod()
            layer.quant_method.process_weights(layer, torch.bfloat16)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_decode_steps_are_bit_equal_to_the_per_module_path(path, arch, threads):
    torch.set_num_threads(threads)
    model = _model(arch)
    _quantize_int8(model)
    cfg = model.config
    backend = TorchAttentionBackend(cfg.num_attention_heads, cfg.num_key_value_heads, 32, BLOCK_SIZE, dtype=torch.bfloat16)
    caches = _caches(model, backend, 32, seed=1)
    start_lens = [1, 15, 16, 17, 31, 33, 40, 60]
    tables = _tables([n + 1 for n in start_lens], 32, seed=2)
    gen = torch.Generator().manual_seed(8)
    for rows in range(1, 9):
        positions, meta = _meta(start_lens[:rows], [1] * rows, tables[:rows])
        input_ids = torch.randint(0, cfg.vocab_size, (rows,), generator=gen)
        expected, expected_caches, got, got_caches = _both_paths(model, backend, caches, input_ids, positions, meta)
        assert torch.equal(got, expected), f"{rows} rows: max diff {(got - expected).abs().max()}"
        for (k1, v1), (k2, v2) in zip(expected_caches, got_caches, strict=True):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_a_short_prefill_chunk_matches_within_bf16_rounding(path):
    # a decode, then 3 tokens of one prompt after 14 cached ones (across a block boundary), then a 4-token prompt
    model = _model("llama")
    cfg = model.config
    backend = TorchAttentionBackend(cfg.num_attention_heads, cfg.num_key_value_heads, 32, BLOCK_SIZE, dtype=torch.bfloat16)
    caches = _caches(model, backend, 16, seed=3)
    lens, num_new = [40, 17, 4], [1, 3, 4]
    positions, meta = _meta(lens, num_new, _tables(lens, 16, seed=5))
    input_ids = torch.randint(0, cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(1))
    expected, expected_caches, got, got_caches = _both_paths(model, backend, caches, input_ids, positions, meta)
    assert torch.equal(expected_caches[0][0], got_caches[0][0])  # the first layer's keys come before attention
    error = (got.float() - expected.float()).norm(dim=-1) / expected.float().norm(dim=-1)
    assert error.max() < 0.02, error


def test_models_and_steps_it_does_not_take(monkeypatch):
    model = _model("llama")
    cfg = model.config
    backend = TorchAttentionBackend(cfg.num_attention_heads, cfg.num_key_value_heads, 32, BLOCK_SIZE, dtype=torch.bfloat16)
    caches = _caches(model, backend, 4, seed=0)
    decoder = cpu_decode.CpuDecoder.build(model, caches, backend)
    assert decoder is not None
    assert not decoder.fits(cpu_decode.MAX_TOKENS + 1) and not decoder.fits(0)
    assert decoder.fits(9) == (cpu_linear.max_rows() >= 9)  # as many rows as the linear kernel takes
    cpu_decode.use_fast_path(False)
    try:
        assert not decoder.fits(1)
    finally:
        cpu_decode.use_fast_path(True)
    for forced in (False, True):  # the fused kernels off, or the Triton ones forced
        monkeypatch.setattr(layers, "use_fused_kernels", forced)
        assert not decoder.fits(1)
    monkeypatch.setattr(layers, "use_fused_kernels", None)
    assert decoder.fits(1) == bool(cpu_linear.fast_paths())  # the portable build runs only when asked for
    monkeypatch.setattr(model.layers[1].mlp.down_proj, "quant_method", object())  # a quantized layer
    assert cpu_decode.CpuDecoder.build(model, caches, backend) is None
    monkeypatch.undo()
    float_model = model.float()
    float_backend = TorchAttentionBackend(cfg.num_attention_heads, cfg.num_key_value_heads, 32, BLOCK_SIZE)
    assert cpu_decode.CpuDecoder.build(float_model, [(k.float(), v.float()) for k, v in caches], float_backend) is None


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_greedy_tokens_of_the_engine_are_the_same_with_and_without_it(monkeypatch, kv_cache_dtype):
    # no prefix caching: the second run would prefill only the prompts' uncached tails, a batch of another size,
    # whose GEMM (the kernel, float32 or oneDNN, by rows) may round the prompt keys differently from the first
    # run's; with int8 it would also read them back quantized where the first attended to them as computed
    llm = LLM(str(ensure_default_model("llama", "small")), dtype="bfloat16", kv_cache_memory=64 << 20,
              kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    decoder = llm.engine.core.runner.cpu_decoder
    assert decoder is not None
    calls = []
    original = type(decoder).__call__
    monkeypatch.setattr(type(decoder), "__call__", lambda self, *args: calls.append(len(args[0])) or original(self, *args))
    prompts = [[5, 17, 99, 3], list(range(100, 137)), [7] * 3, list(range(2000, 2020)), [4000]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with_decoder = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert calls and max(calls) <= cpu_decode.MAX_TOKENS
    cpu_decode.use_fast_path(False)
    try:
        calls.clear()
        without = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    finally:
        cpu_decode.use_fast_path(True)
    assert not calls
    assert with_decoder == without
    assert all(len(tokens) == 32 for tokens in with_decoder)


@pytest.mark.parametrize("threads", [1, 2])
def test_lora_adapters_in_a_step_match_the_per_module_path(path, threads):
    """Rows of two adapters and of none in one decode step: the one-call decoder adds each row's adapter as the
    per-module path does, to the bit, and the adapters change the rows they serve."""
    torch.set_num_threads(threads)
    model = _model("qwen2")
    cfg = model.config
    slots = LoRASlots(model, max_loras=2, max_rank=8, max_cpu_loras=2, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(7)
    for layer in slots.layers.values():
        layer.a.copy_(0.1 * torch.randn(layer.a.shape, generator=gen))
        layer.bt.copy_(0.1 * torch.randn(layer.bt.shape, generator=gen))
    slots.slot_of = {11: 0, 12: 1}  # two adapters' weights in the slots
    backend = TorchAttentionBackend(cfg.num_attention_heads, cfg.num_key_value_heads, 32, BLOCK_SIZE, dtype=torch.bfloat16)
    caches = _caches(model, backend, 32, seed=3)
    lens = [40, 17, 23, 9]
    positions, meta = _meta(lens, [1] * 4, _tables(lens, 32, seed=5))
    input_ids = torch.randint(0, cfg.vocab_size, (4,), generator=torch.Generator().manual_seed(1))
    slots.activate([0, 11, 12, 11], np.ones(4, dtype=np.int64), torch.device("cpu"))
    expected, _, got, _ = _both_paths(model, backend, caches, input_ids, positions, meta, slots.token_slots)
    assert torch.equal(got, expected), f"max diff {(got - expected).abs().max()}"
    slots.activate([0, 0, 0, 0], np.ones(4, dtype=np.int64), torch.device("cpu"))
    base, _, _, _ = _both_paths(model, backend, caches, input_ids, positions, meta)
    assert torch.equal(base[0], expected[0])  # the row without an adapter
    changed = (base.float() - expected.float()).norm(dim=-1) / base.float().norm(dim=-1)
    assert (changed[1:] > 0.1).all(), changed


@pytest.mark.skipif(cpu_lora.load() is None, reason="the LoRA kernel could not be built here")
@pytest.mark.parametrize("threads", [1, 2])
def test_lora_kernel_adds_each_rows_adapter(path, threads):
    """Each row's (x A^T) B^T of its slot, rounded as stored (the shrink, the expand, the sum), to rows of two slots
    and of none (21 rows: more than a pass of shrunk rows and of expanded ones; 1003 columns: a partial block);
    a slot's zero rows beyond the rank change nothing."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(21, 96, generator=gen).to(torch.bfloat16)
    a = (0.2 * torch.randn(2, 48, 96, generator=gen)).to(torch.bfloat16)
    a[:, 40:] = 0
    bt = torch.randn(2, 48, 1003, generator=gen).to(torch.bfloat16)
    out = torch.randn(21, 1003, generator=gen).to(torch.bfloat16)
    slots = torch.tensor([i % 3 - 1 for i in range(21)], dtype=torch.int32)
    expected = out.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            shrunk = (x[t].float() @ a[slot].float().T).to(torch.bfloat16)
            expand = (shrunk.float() @ bt[slot].float()).to(torch.bfloat16)
            expected[t] = (out[t].float() + expand.float()).to(torch.bfloat16)
    cpu_lora.add(out, x, slots, a, bt)
    assert torch.equal(out[slots < 0], expected[slots < 0])
    torch.testing.assert_close(out.float(), expected.float(), rtol=0.016, atol=0.05)
