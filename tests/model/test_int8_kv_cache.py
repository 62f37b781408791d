"""`--kv-cache-dtype int8` on the torch backend: attention over the quantized cache on every read path, the
pool it buys, the engine serving from it, and the backends that refuse it."""

from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.config import EngineConfig
from llmserve.model import cpu_decode
from llmserve.model.attention import (
    AttentionMetadata,
    TorchAttentionBackend,
    TritonAttentionBackend,
    cpu_kernels,
)
from llmserve.model.config import ModelConfig
from llmserve.model.runner import ModelRunner

HEADS, KV_HEADS, DIM, BLOCK = 8, 2, 64, 16


def _meta(computed: list[int], new: list[int], tables: list[list[int]]) -> AttentionMetadata:
    """One step where sequence i has computed[i] tokens cached and computes new[i] more."""
    slots, starts = [], [0]
    for done, count, table in zip(computed, new, tables, strict=True):
        slots += [table[pos // BLOCK] * BLOCK + pos % BLOCK for pos in range(done, done + count)]
        starts.append(starts[-1] + count)
    lens = [done + count for done, count in zip(computed, new, strict=True)]
    decodes = next((i for i, count in enumerate(new) if count != 1), len(new))
    width = max(map(len, tables))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        num_decodes=decodes, num_decode_tokens=decodes, max_seq_len=max(lens),
        query_start_loc_host=starts, seq_lens_host=lens,
    )


def _run_steps(backend: TorchAttentionBackend) -> list[torch.Tensor]:
    """Attention outputs of three steps over two sequences: fresh prompts (40 and 7 tokens), then a second
    chunk of the first prompt (24 tokens read back from the cache) beside a decode, then two decodes."""
    gen = torch.Generator().manual_seed(0)
    caches = [torch.zeros(backend.kv_cache_shape(12), dtype=backend.kv_cache_dtype) for _ in range(2)]
    tables = [[3, 7, 1, 9, 0], [5, 2]]
    outputs = []
    for computed, new in (([0, 0], [40, 7]), ([40, 7], [24, 1]), ([64, 8], [1, 1])):
        order = sorted(range(2), key=lambda i: new[i] != 1)  # decodes first
        meta = _meta([computed[i] for i in order], [new[i] for i in order], [tables[i] for i in order])
        tokens = sum(new)
        q, k, v = (torch.randn(tokens, h, DIM, generator=gen).to(torch.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS))
        backend.prepare(meta)
        outputs.append(backend.forward(q, k, v, caches[0], caches[1], meta).float())
    return outputs


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


def test_attention_over_an_int8_cache_stays_close_to_bf16_on_every_read_path(monkeypatch):
    full = _run_steps(TorchAttentionBackend(HEADS, KV_HEADS, DIM, BLOCK, dtype=torch.bfloat16))
    quantized = _run_steps(TorchAttentionBackend(HEADS, KV_HEADS, DIM, BLOCK, torch.bfloat16, torch.int8))
    # fresh prompts attend to their own unquantized keys: the same bits
    assert torch.equal(quantized[0], full[0])
    # the chunk (gathered, dequantized) and the decodes (the C kernel) read int8: ~0.5% per value
    for got, expected in zip(quantized[1:], full[1:], strict=True):
        assert _relative_error(got, expected) < 0.02
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)  # no kernel: decodes gather and dequantize too
    gathered = _run_steps(TorchAttentionBackend(HEADS, KV_HEADS, DIM, BLOCK, torch.bfloat16, torch.int8))
    for got, expected in zip(gathered, quantized, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)  # the same cache, read two ways


def _runner(model_dir, kv_cache_dtype: str) -> ModelRunner:
    config = EngineConfig(model=str(model_dir), dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, kv_cache_memory=1 << 20)
    return ModelRunner(config, ModelConfig.from_pretrained(model_dir), model_dir, max_model_len=64)


def test_an_int8_cache_holds_almost_twice_the_tokens(tiny_llama_dir):
    cfg = ModelConfig.from_pretrained(tiny_llama_dir)
    int8, bf16 = _runner(tiny_llama_dir, "int8"), _runner(tiny_llama_dir, "auto")
    per_block = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * BLOCK * (cfg.head_dim + 2)
    assert int8.kv_caches[0][0].dtype == torch.int8
    assert int8.num_blocks == (1 << 20) // per_block and int8.kv_cache_bytes == int8.num_blocks * per_block
    assert int8.num_blocks / bf16.num_blocks == pytest.approx(2 * cfg.head_dim / (cfg.head_dim + 2), rel=0.01)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_serves_from_an_int8_cache_without_leaking_blocks(tiny_llama_dir, dtype):
    llm = LLM(str(tiny_llama_dir), dtype=dtype, kv_cache_dtype="int8", num_kv_blocks=32, max_model_len=256,
              max_num_batched_tokens=32, enable_prefix_caching=True)
    runner = llm.engine.core.runner
    # bf16 decodes run in one C call; float32 ones gather and dequantize (the kernel takes bf16 queries only)
    assert (runner.cpu_decoder is not None) == (dtype == "bfloat16" and cpu_decode.load() is not None)
    shared = list(range(10, 60))  # a 50-token prefix: the second request reads its cached blocks back
    prompts = [{"prompt_token_ids": shared + [5, 6]}, {"prompt_token_ids": shared + [7]}, "Once upon a time"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in first] == [12, 12, 12]
    # Later runs find at least the prompts' full blocks in the cache (48 of 52 and of 51 tokens) and read them back
    # quantized, where the first run attended to those keys as computed: their tokens may differ from the
    # first run's, never from each other's.
    second, third = llm.generate(prompts, params), llm.generate(prompts, params)
    assert all(o.num_cached_tokens >= 48 for o in second[:2])
    assert [o.outputs[0].token_ids for o in third] == [o.outputs[0].token_ids for o in second]
    blocks = llm.engine.core.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks


def test_backends_name_the_kv_cache_dtypes_they_store():
    with pytest.raises(ValueError, match="cannot keep the KV cache in torch.int8.*'torch' backend's"):
        TritonAttentionBackend(HEADS, KV_HEADS, DIM, BLOCK, torch.bfloat16, kv_cache_dtype=torch.int8)
    with pytest.raises(ValueError, match="cannot keep the KV cache in torch.float8_e4m3fn.*int8"):
        TorchAttentionBackend(HEADS, KV_HEADS, DIM, BLOCK, torch.bfloat16, kv_cache_dtype=torch.float8_e4m3fn)
