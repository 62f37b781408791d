"""The runner's GPU path: graph sizes and padding, graph-or-eager choice, KV sizing from a profiled peak,
dtype and backend defaults, and steps without host reads. Everything but the real CUDA graphs and
memory readings runs on CPU; the CUDA checks are marked `gpu`."""

from __future__ import annotations

import gc
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.config import EngineConfig
from llmserve.model.attention import BACKENDS, AttentionMetadata, TorchAttentionBackend
from llmserve.model.config import ModelConfig
from llmserve.model.cuda_graphs import (
    PAD_SLOT,
    DecodeGraphs,
    EagerReplay,
    StaticDecodeInputs,
    graph_batch_sizes,
    graph_size_for,
    padded_batch_size,
)
from llmserve.model.memory import MemoryProfile, kv_cache_budget, num_kv_blocks, profile_prompt_lengths
from llmserve.model.runner import (
    ModelRunner,
    StepBatch,
    _padded_block_tables,
    choose_attention_backend,
    resolve_dtype,
)
from llmserve.sampling.sampler import Sampler, SamplingMetadata, SamplingRow

GiB = 1 << 30
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# ---- graph sizes and the graph-or-eager choice ----------------------------------------------------
def test_default_graph_sizes_ladder() -> None:
    assert graph_batch_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert graph_batch_sizes(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(1024)[-3:] == [480, 496, 512]


def test_configured_graph_sizes_are_sorted_and_capped() -> None:
    assert graph_batch_sizes(256, [64, 1, 8, 1000, 8]) == [1, 8, 64]


@pytest.mark.parametrize(
    ("num_seqs", "expected"), [(1, 1), (3, 4), (5, 8), (9, 16), (17, 32), (255, 256), (256, 256), (257, None)]
)
def test_padded_batch_size(num_seqs: int, expected: int | None) -> None:
    assert padded_batch_size(num_seqs, graph_batch_sizes(256)) == expected


def test_graph_only_for_decode_only_steps_that_fit() -> None:
    sizes = [1, 2, 4]
    assert graph_size_for(3, 3, sizes) == 4
    assert graph_size_for(3, 2, sizes) is None  # a prefill chunk in the step: eager
    assert graph_size_for(5, 5, sizes) is None  # above the largest graph: eager
    assert graph_size_for(0, 0, sizes) is None


def test_static_inputs_copy_a_step_and_pad_the_rest() -> None:
    inputs = StaticDecodeInputs.allocate(max_batch=4, max_blocks_per_seq=3, device=torch.device("cpu"))
    # Stale values from a previous, larger step must not survive in the padded rows.
    inputs.input_ids.fill_(9)
    inputs.slot_mapping.fill_(77)
    inputs.seq_lens.fill_(50)
    inputs.block_tables.fill_(6)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([35, 18]), query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([36, 3], dtype=torch.int32), block_tables=torch.tensor([[1, 2], [5, 0]], dtype=torch.int32),
        num_decodes=2, num_decode_tokens=2, max_seq_len=36, query_start_loc_host=[0, 1, 2], seq_lens_host=[36, 3],
    )
    inputs.load(torch.tensor([11, 12]), torch.tensor([35, 2]), meta, batch=4)
    assert inputs.input_ids.tolist() == [11, 12, 0, 0]
    assert inputs.positions.tolist() == [35, 2, 0, 0]
    assert inputs.slot_mapping.tolist() == [35, 18, PAD_SLOT, PAD_SLOT]
    assert inputs.seq_lens.tolist() == [36, 3, 1, 1]
    assert inputs.block_tables.tolist() == [[1, 2, 6], [5, 0, 6], [0, 0, 0], [0, 0, 0]]
    assert inputs.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    capture = inputs.capture_metadata(batch=2, max_seq_len=1024)
    assert (capture.num_decodes, capture.max_seq_len, capture.seq_lens_host) == (2, 1024, [1024, 1024])
    assert capture.block_tables.data_ptr() == inputs.block_tables.data_ptr()


def test_decode_graphs_capture_largest_first_and_replay_padded() -> None:
    calls: list[int] = []

    def forward(input_ids, positions, meta):
        calls.append(input_ids.shape[0])
        return torch.stack([input_ids.float(), positions.float(), meta.seq_lens.float()], dim=1)

    backend = TorchAttentionBackend(4, 2, 16, 16)
    graphs = DecodeGraphs(forward, backend, [1, 2, 4], 64, 16, torch.device("cpu"), EagerReplay())
    assert calls == []  # EagerReplay records nothing up front
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([5, 21, 40]), query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
        seq_lens=torch.tensor([6, 22, 41], dtype=torch.int32),
        block_tables=torch.tensor([[0, 0, 0], [1, 2, 0], [3, 4, 7]], dtype=torch.int32),
        num_decodes=3, num_decode_tokens=3, max_seq_len=41, query_start_loc_host=[0, 1, 2, 3],
        seq_lens_host=[6, 22, 41],
    )
    out = graphs.run(torch.tensor([7, 8, 9]), torch.tensor([5, 21, 40]), meta)
    assert calls == [4]  # padded up to the graph of 4
    assert out.tolist() == [[7.0, 5.0, 6.0], [8.0, 21.0, 22.0], [9.0, 40.0, 41.0]]
    assert graphs.inputs.block_tables.shape == (4, 4)  # ceil(64 / 16) blocks per sequence


# ---- the graph path end to end on CPU (EagerReplay) -----------------------------------------------
class PaddingAwareTorchBackend(TorchAttentionBackend):
    """The torch backend, skipping padded (slot -1) rows on write as graph-safe backends must."""

    name = "torch-skip-padding"

    def write_kv(self, key, value, k_cache, v_cache, meta) -> None:
        keep = meta.slot_mapping >= 0
        blocks, offsets = meta.backend_data["slot_block"][keep], meta.backend_data["slot_offset"][keep]
        k_cache[blocks, :, offsets] = key[keep]
        v_cache[blocks, :, offsets] = value[keep]


def _greedy_outputs(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_decode_graph_path_matches_eager(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(BACKENDS, PaddingAwareTorchBackend.name, PaddingAwareTorchBackend)
    kwargs = dict(dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=256, max_num_seqs=8,
                  attention_backend=PaddingAwareTorchBackend.name, cuda_graph_sizes=[1, 2, 4])
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 1000) for _ in range(rng.randint(5, 40))] for _ in range(6)]
    max_tokens = [3, 5, 7, 9, 11, 13]
    expected = _greedy_outputs(LLM(str(tiny_llama_dir), **kwargs), prompts, max_tokens)

    graphed = LLM(str(tiny_llama_dir), **kwargs)
    runner = graphed.engine.core.runner
    assert runner.graphs is None  # graphs are only captured on CUDA by default
    runner.capture_decode_graphs(EagerReplay())
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4]
    replays: list[tuple[int, int]] = []
    run = runner.graphs.run

    def spy(input_ids, positions, meta):
        replays.append((input_ids.shape[0], runner.graphs.size_for(meta)))
        return run(input_ids, positions, meta)

    monkeypatch.setattr(runner.graphs, "run", spy)
    assert _greedy_outputs(graphed, prompts, max_tokens) == expected
    # Decode batches shrink 6, 6, 5, 5, 4, 4, ...: 6 and 5 exceed the largest graph and run eagerly.
    assert replays == [(4, 4), (4, 4), (3, 4), (3, 4), (2, 2), (2, 2), (1, 1), (1, 1)]


# ---- KV pool sizing -------------------------------------------------------------------------------
def test_kv_budget_from_profiled_peak() -> None:
    profile = MemoryProfile(total_bytes=80 * GiB, peak_torch_bytes=18 * GiB, non_torch_bytes=GiB)
    assert profile.non_kv_bytes == 19 * GiB
    assert kv_cache_budget(profile, 0.75) == 41 * GiB
    assert num_kv_blocks(41 * GiB, 2 * 1024 * 1024) == 20992


def test_kv_budget_error_when_nothing_is_left() -> None:
    profile = MemoryProfile(total_bytes=16 * GiB, peak_torch_bytes=15 * GiB, non_torch_bytes=GiB // 2)
    with pytest.raises(ValueError, match=r"No memory left for the KV cache.*15\.00 GiB"):
        kv_cache_budget(profile, 0.9)
    with pytest.raises(ValueError, match="holds no block"):
        num_kv_blocks(1000, 4096)


def test_profile_prompt_lengths() -> None:
    assert profile_prompt_lengths(8192, 2048) == [2048] * 4
    assert profile_prompt_lengths(1000, 2048) == [1000]
    assert profile_prompt_lengths(5000, 2048) == [2048, 2048, 904]


def test_profile_step_runs_on_a_scratch_cache(tiny_llama_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=8,
                          max_num_batched_tokens=100, max_num_seqs=5)
    runner = ModelRunner(config, ModelConfig.from_pretrained(tiny_llama_dir), tiny_llama_dir, max_model_len=64)
    # Prompts of 64 + 36 tokens take 4 + 3 blocks; 2 layers * (keys, values) * 7 blocks * 16 * 2 heads * 16 * 4 B.
    assert runner.run_profile_step() == 2 * 2 * 7 * 16 * 2 * 16 * 4
    assert all(not k.any() and not v.any() for k, v in runner.kv_caches)  # the engine's pool is untouched


def test_profile_step_runs_while_the_runner_is_built(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the pool is sized by a profiling step taken during construction, before the KV cache (and
    what is built on it) exists; here the CPU runner is made to size its pool the same way."""
    monkeypatch.setattr(ModelRunner, "_decide_num_blocks", lambda self, shared: (self.run_profile_step(), 8)[1])
    config = EngineConfig(model=str(tiny_llama_dir), dtype="bfloat16", device="cpu", max_num_batched_tokens=100,
                          max_num_seqs=5)
    runner = ModelRunner(config, ModelConfig.from_pretrained(tiny_llama_dir), tiny_llama_dir, max_model_len=64)
    assert runner.num_blocks == 8 and len(runner.kv_caches) == 2


# ---- dtype and backend defaults -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("requested", "checkpoint", "device", "expected"),
    [
        ("auto", torch.float32, "cpu", torch.float32),
        ("auto", torch.bfloat16, "cpu", torch.bfloat16),
        ("auto", torch.float32, "cuda", torch.bfloat16),
        ("auto", torch.bfloat16, "cuda", torch.bfloat16),
        ("auto", torch.float16, "cuda", torch.float16),
        ("float32", torch.bfloat16, "cuda", torch.float32),
    ],
)
def test_resolve_dtype(requested: str, checkpoint: torch.dtype, device: str, expected: torch.dtype) -> None:
    assert resolve_dtype(requested, checkpoint, torch.device(device)) == expected


def test_backend_default_is_triton_on_cuda_with_torch_fallback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delitem(BACKENDS, "triton", raising=False)
    with caplog.at_level(logging.WARNING, logger="llmserve.model.runner"):
        assert choose_attention_backend(None, torch.device("cuda")) is TorchAttentionBackend
    assert "'triton' is unavailable" in caplog.text
    fake_triton = type("FakeTriton", (TorchAttentionBackend,), {"name": "triton"})
    monkeypatch.setitem(BACKENDS, "triton", fake_triton)
    assert choose_attention_backend(None, torch.device("cuda")) is fake_triton
    assert choose_attention_backend(None, torch.device("cpu")) is TorchAttentionBackend
    with pytest.raises(ValueError, match="Unknown attention backend"):
        choose_attention_backend("no-such-backend", torch.device("cuda"))


# ---- input preparation ----------------------------------------------------------------------------
def test_padded_block_tables() -> None:
    assert _padded_block_tables([[3, 4], [7], [1, 2, 5]]).tolist() == [[3, 4, 0], [7, 0, 0], [1, 2, 5]]
    assert _padded_block_tables([[3, 4], [7]]).dtype == np.int32


def test_prepare_step_for_decodes_then_a_prefill_chunk(tiny_llama_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=8, block_size=4)
    runner = ModelRunner(config, ModelConfig.from_pretrained(tiny_llama_dir), tiny_llama_dir, max_model_len=64)
    row = SamplingRow(SamplingParams(temperature=0), seed=0, sample_index=0, prompt_token_ids=(), output_token_ids=())
    # A decode at position 4 (blocks 2, 6), then a prefill chunk of 3 tokens from position 2 (blocks 1, 3).
    batch = StepBatch(np.array([9, 3, 4, 5]), np.array([4, 2]), np.array([1, 3]), [[2, 6], [1, 3]], [1, 0], [row, row])
    inputs = runner.prepare_step(batch)
    meta = inputs.meta
    assert inputs.input_ids.tolist() == [9, 3, 4, 5]
    assert inputs.positions.tolist() == [4, 2, 3, 4]
    assert meta.slot_mapping.tolist() == [6 * 4 + 0, 1 * 4 + 2, 1 * 4 + 3, 3 * 4 + 0]
    assert meta.query_start_loc.tolist() == [0, 1, 4] and meta.seq_lens.tolist() == [5, 5]
    assert meta.block_tables.tolist() == [[2, 6], [1, 3]]
    assert (meta.num_decodes, meta.max_seq_len) == (1, 5)
    assert inputs.logits_index is not None and inputs.logits_index.tolist() == [3, 0]
    assert inputs.sampling is not None and inputs.sampling.batch_size == 2


def test_prepare_inputs_for_decodes_only_reads_each_slot_from_its_own_block(tiny_llama_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=8, block_size=4)
    runner = ModelRunner(config, ModelConfig.from_pretrained(tiny_llama_dir), tiny_llama_dir, max_model_len=64)
    # At a block's start (position 4), mid-block (position 6) and a first token (position 0).
    batch = StepBatch(np.array([5, 7, 9]), np.array([4, 6, 0]), np.array([1, 1, 1]), [[7, 2], [5, 3], [4]], [], [])
    input_ids, positions, meta = runner.prepare_inputs(batch)
    assert input_ids.tolist() == [5, 7, 9] and positions.tolist() == [4, 6, 0]
    assert meta.slot_mapping.tolist() == [2 * 4 + 0, 3 * 4 + 2, 4 * 4 + 0]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3] and meta.seq_lens.tolist() == [5, 7, 1]
    assert meta.block_tables.tolist() == [[7, 2], [5, 3], [4, 0]]
    assert (meta.num_decodes, meta.max_seq_len, meta.seq_lens_host) == (3, 7, [5, 7, 1])


def test_a_pending_token_is_the_previous_steps_sample_taken_on_the_device(tiny_llama_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_blocks=8, block_size=4)
    runner = ModelRunner(config, ModelConfig.from_pretrained(tiny_llama_dir), tiny_llama_dir, max_model_len=64)
    row = SamplingRow(SamplingParams(temperature=0), seed=0, sample_index=0, prompt_token_ids=(), output_token_ids=())
    prompt = [5, 17, 300, 41, 9]
    first = runner.execute(StepBatch(np.array(prompt), np.array([0]), np.array([5]), [[0, 1]], [0], [row])).result()
    assert first is not None
    # The next step names its input as sample 0 of the step before; the host never sees the id.
    pending = StepBatch(np.array([0]), np.array([5]), np.array([1]), [[0, 1]], [0], [row],
                        pending_index=np.array([0]), pending_source=np.array([0]))
    second = runner.execute(pending).result()
    known = StepBatch(np.array(first.token_ids), np.array([5]), np.array([1]), [[0, 1]], [0], [row])
    assert second is not None and runner.execute(known).result().token_ids == second.token_ids


# ---- sampling without host reads ------------------------------------------------------------------
def _mixed_rows(vocab: int) -> tuple[torch.Tensor, list[SamplingRow]]:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(7, vocab, generator=gen) * 3
    logits[5] = torch.randn(vocab, generator=gen) * 0.01  # flat: its nucleus needs far more than 128 candidates
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=20),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.2, top_k=50, top_p=0.8, logprobs=3),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=1.0, top_p=0.95),
        SamplingParams(temperature=0.7, top_k=5, min_p=0.1),
    ]
    rows = [SamplingRow(p, seed=100 + i, sample_index=i, prompt_token_ids=(), output_token_ids=())
            for i, p in enumerate(params)]
    return logits, rows


def _forbid_host_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def host_read(*_args, **_kwargs):
        raise AssertionError("a tensor was read back to the host")

    for method in ("__bool__", "item", "tolist", "numpy"):
        monkeypatch.setattr(torch.Tensor, method, host_read)


def test_sync_free_sampler_draws_the_same_without_host_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    logits, rows = _mixed_rows(2000)
    metadata = SamplingMetadata.build(rows, 2000)
    expected = Sampler(sync_free=False)(logits, metadata)
    with monkeypatch.context() as patch:
        _forbid_host_reads(patch)
        out = Sampler(sync_free=True)(logits, metadata)
        with pytest.raises(AssertionError, match="read back"):
            Sampler(sync_free=False)(logits, metadata)  # the host path does read: the check is live
    assert torch.equal(out.token_ids, expected.token_ids)
    assert out.logprobs is not None and expected.logprobs is not None
    torch.testing.assert_close(out.logprobs, expected.logprobs)


# ---- CUDA ---------------------------------------------------------------------------------------
def _has_triton_backend() -> bool:
    try:
        from llmserve.model.attention import get_backend

        get_backend("triton")
    except (ValueError, ImportError):
        return False
    return True


def _release_cuda_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def small_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from llmserve.model.builtin import make_model

    return make_model(tmp_path_factory.mktemp("small-llama"), "llama", "small", 0)


def _cuda_prompts() -> tuple[list[list[int]], list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 8000) for _ in range(rng.randint(8, 300))] for _ in range(24)]
    return prompts, [rng.randint(4, 48) for _ in prompts]


@pytest.mark.gpu
@needs_cuda
def test_cuda_defaults_bfloat16_profiled_pool_and_graphs(small_llama_dir: Path) -> None:
    llm = LLM(str(small_llama_dir), max_model_len=2048, max_num_seqs=32, gpu_memory_utilization=0.5)
    runner = llm.engine.core.runner
    assert runner.dtype == torch.bfloat16  # the checkpoint is float32
    profile = runner.memory_profile
    assert profile is not None and profile.peak_torch_bytes > 0
    per_block = llm.engine.facts.model_config.kv_bytes_per_token(torch.bfloat16) * 16
    assert runner.num_blocks == (int(profile.total_bytes * 0.5) - profile.non_kv_bytes) // per_block
    assert (runner.graphs is not None) == (runner.attn_backend.name == "triton")
    del llm, runner
    _release_cuda_memory()  # a live engine's memory would count against the next one's budget
    eager = LLM(str(small_llama_dir), max_model_len=2048, max_num_seqs=32, gpu_memory_utilization=0.3,
                enforce_eager=True)
    assert eager.engine.core.runner.graphs is None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(not _has_triton_backend(), reason="needs the triton attention backend")
def test_cuda_graphs_and_backends_agree_in_float32(small_llama_dir: Path) -> None:
    prompts, max_tokens = _cuda_prompts()
    results = {}
    for backend, eager in (("torch", True), ("triton", True), ("triton", False)):
        llm = LLM(str(small_llama_dir), dtype="float32", max_model_len=1024, max_num_seqs=16,
                  attention_backend=backend, enforce_eager=eager, gpu_memory_utilization=0.3)
        assert (llm.engine.core.runner.graphs is None) == eager
        results[(backend, eager)] = _greedy_outputs(llm, prompts, max_tokens)
        del llm
        _release_cuda_memory()
    reference = results[("torch", True)]
    assert results[("triton", True)] == reference
    assert results[("triton", False)] == reference


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(not _has_triton_backend(), reason="needs the triton attention backend")
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs compute capability 9.0")
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_programmatic_dependent_launch_changes_no_token(small_llama_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                        quantization: str | None) -> None:
    """The same kernels and sums with and without PDL (llmserve.pdl), in CUDA graphs: the same tokens, bf16."""
    from llmserve import pdl

    prompts, max_tokens = _cuda_prompts()
    results = {}
    for enabled in (False, True):
        monkeypatch.setattr(pdl, "enabled", enabled)
        assert pdl.launch_options(torch.empty(1, device="cuda")).get("launch_pdl", False) == enabled
        llm = LLM(str(small_llama_dir), max_model_len=1024, max_num_seqs=16, quantization=quantization,
                  gpu_memory_utilization=0.3)
        assert llm.engine.core.runner.graphs is not None
        results[enabled] = _greedy_outputs(llm, prompts, max_tokens)
        del llm
        _release_cuda_memory()
    assert results[True] == results[False]


@pytest.mark.gpu
@needs_cuda
def test_cuda_step_reads_nothing_back_until_the_sampled_ids(small_llama_dir: Path) -> None:
    llm = LLM(str(small_llama_dir), max_model_len=1024, max_num_seqs=8, gpu_memory_utilization=0.3)
    engine = llm.engine
    for i in range(4):
        engine.add_request(f"r{i}", list(range(10, 60 + i)), SamplingParams(temperature=1.0, top_p=0.9, max_tokens=64,
                                                                             ignore_eos=True, logprobs=2))
    while any(s.num_output_tokens < 2 for s in engine.core.live_sequences()):
        engine.step()  # prefill, then decodes (one of them in flight, with a pending token each)
    batch = engine.core.build_step_batch(engine.core.scheduler.schedule())
    assert batch.pending_index is not None  # its inputs come from the step still running
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        handle = engine.core.runner.execute(batch)  # inputs sent, forward, sampling, ids on their way back
    finally:
        torch.cuda.set_sync_debug_mode("default")
    output = handle.result()
    assert output is not None and len(output.token_ids) == 4


def test_cli_engine_flags_for_the_gpu_path() -> None:
    from llmserve.cli import build_parser
    from llmserve.config import engine_config_kwargs

    parse = build_parser().parse_args
    kwargs = engine_config_kwargs(parse(["generate", "--prompt", "x", "--enforce-eager",
                                         "--gpu-memory-utilization", "0.8", "--attention-backend", "torch"]))
    assert (kwargs["enforce_eager"], kwargs["gpu_memory_utilization"], kwargs["attention_backend"]) == (True, 0.8, "torch")
    defaults = engine_config_kwargs(parse(["serve"]))
    assert (defaults["enforce_eager"], defaults["gpu_memory_utilization"], defaults["attention_backend"]) == (
        False, 0.9, None)
    assert EngineConfig(model="m", **defaults).enforce_eager is False
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineConfig(model="m", cuda_graph_sizes=[0, 8]).validate()
