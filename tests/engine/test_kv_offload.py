"""The prefix cache's second tier: blocks evicted from a small pool are saved (in memory, or in files that
outlive the engine) and loaded back when a prompt starts with them again: the answer is token for token the
one computing them gives, only the prompt's last block is computed, the tier stays within its size, and no
block leaks."""

from __future__ import annotations

import pytest

from llmserve.config import EngineConfig
from llmserve.engine.kv_offload import DiskKVTier, MemoryKVTier, join_blocks, split_blocks
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.prefix_cache import hash_root
from llmserve.engine.sequence import Request, Sequence
from llmserve.outputs import RequestOutput
from llmserve.sampling.params import SamplingParams

BLOCK = 16
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(150)]  # 9 full blocks and 6 tokens
OTHERS = [[(13 * i + 5 * k) % 240 + 2 for i in range(150)] for k in range(1, 4)]  # enough to evict PROMPT's


def _engine(model_dir, **overrides) -> LLMEngine:
    kwargs = dict(dtype="float32", num_kv_blocks=24, max_model_len=256, max_num_batched_tokens=256,
                  block_size=BLOCK, kv_offload_gib=0.01)
    kwargs.update(overrides)
    return LLMEngine(EngineConfig(model=str(model_dir), **kwargs))


def _run(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[RequestOutput, int]:
    """The answer, and the prompt tokens the engine's steps computed for it."""
    engine.add_request(request_id, prompt, GREEDY)
    final, computed = None, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final = output
        if engine.core.last_step is not None:
            computed += engine.core.last_step.num_prefill_tokens
            engine.core.last_step = None
    assert final is not None
    return final, computed


def _evict_then_ask_again(engine: LLMEngine) -> tuple[list[int], list[int], int]:
    first, computed = _run(engine, "first", PROMPT)
    assert computed == len(PROMPT)
    for k, other in enumerate(OTHERS):
        _run(engine, f"other-{k}", other)
    bm, probe = engine.core.block_manager, _probe(engine, PROMPT)
    names = [bm._block_hash(probe, k) for k in range(9)]
    assert not any(name in bm.cache.by_hash for name in names)  # evicted from the pool...
    assert all(name in engine.core.tier for name in names)  # ...into the tier
    assert bm.num_cached_prefix_blocks(probe) == 9  # which counts as cached
    again, computed = _run(engine, "again", PROMPT)
    return first.outputs[0].token_ids, again.outputs[0].token_ids, computed


def _probe(engine: LLMEngine, prompt: list[int]) -> Sequence:
    """A sequence of `prompt` under the model's own cache namespace (no salt, no adapter), to look it up."""
    request = Request("probe", prompt, GREEDY, seed=0, arrival_order=0,
                      cache_root=hash_root(*engine.core._cache_identity, None, None))
    return Sequence(request, 0, list(prompt), len(prompt), 0)


def _assert_no_leak(engine: LLMEngine) -> None:
    engine.check_invariants()
    assert engine.stats().num_used_blocks == 0


def test_blocks_evicted_to_memory_come_back_and_give_the_same_answer(tiny_llama_dir):
    engine = _engine(tiny_llama_dir)
    try:
        want, got, computed = _evict_then_ask_again(engine)
        assert got == want
        assert computed == len(PROMPT) - 9 * BLOCK  # the 9 full blocks were loaded, not computed
        stats = engine.stats()
        assert stats.kv_offload_loaded == 9 and stats.kv_offload_saved >= 9
        assert isinstance(engine.core.tier, MemoryKVTier)
        _assert_no_leak(engine)
    finally:
        engine.core.shutdown()


def test_a_disk_tier_outlives_the_engine(tiny_llama_dir, tmp_path):
    engine = _engine(tiny_llama_dir, kv_offload_dir=str(tmp_path), num_kv_blocks=64)
    try:
        want, computed = _run(engine, "first", PROMPT)
        assert computed == len(PROMPT)
    finally:
        engine.core.shutdown()  # the pool's named blocks are saved
    assert isinstance(engine.core.tier, DiskKVTier) and len(engine.core.tier) >= 9
    restarted = _engine(tiny_llama_dir, kv_offload_dir=str(tmp_path), num_kv_blocks=64)
    try:
        got, computed = _run(restarted, "again", PROMPT)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert computed == len(PROMPT) - 9 * BLOCK
        assert got.num_cached_tokens == 9 * BLOCK  # KV found in a cache: billed as cached
        _assert_no_leak(restarted)
    finally:
        restarted.core.shutdown()


def test_a_disk_tier_of_other_weights_is_never_read(tiny_llama_dir, tiny_qwen3_dir, tmp_path):
    engine = _engine(tiny_llama_dir, kv_offload_dir=str(tmp_path), num_kv_blocks=64)
    _run(engine, "first", PROMPT)
    engine.core.shutdown()
    other = _engine(tiny_qwen3_dir, kv_offload_dir=str(tmp_path), num_kv_blocks=64)
    try:
        assert len(other.core.tier) == 0  # another model's directory
        _, computed = _run(other, "again", PROMPT)
        assert computed == len(PROMPT)
    finally:
        other.core.shutdown()


def test_the_tier_keeps_to_its_size_dropping_the_least_recently_used():
    tier = MemoryKVTier(capacity_bytes=250)
    for i in range(4):
        tier.put(bytes([i]) * 16, b"x" * 100)
    assert len(tier) == 2 and tier.num_bytes == 200
    assert bytes([0]) * 16 not in tier and bytes([3]) * 16 in tier
    assert tier.get(bytes([2]) * 16) == b"x" * 100  # now the most recently used
    tier.put(bytes([9]) * 16, b"y" * 100)
    assert bytes([2]) * 16 in tier and bytes([3]) * 16 not in tier
    tier.put(bytes([8]) * 16, b"z" * 300)  # bigger than the whole tier: not kept
    assert bytes([8]) * 16 not in tier and tier.num_bytes == 200


def test_a_disk_tier_finds_its_files_and_forgets_a_missing_one(tmp_path):
    tier = DiskKVTier(1000, tmp_path)
    names = [bytes([i]) * 16 for i in range(3)]
    for name in names:
        tier.put(name, name * 4)
    again = DiskKVTier(1000, tmp_path)
    assert all(name in again for name in names) and again.num_bytes == 3 * 64
    (tmp_path / names[1].hex()).unlink()
    assert again.get(names[1]) is None and names[1] not in again and again.num_bytes == 2 * 64
    assert again.get(names[2]) == names[2] * 4
    assert DiskKVTier(64, tmp_path).num_bytes == 64  # a smaller tier keeps the newest files only


def test_blobs_split_and_join_back():
    frames = [memoryview(bytes(range(12))), memoryview(bytes(range(100, 112)))]  # 2 frames of 3 blocks, 4 bytes each
    blobs = split_blocks(frames, 3)
    assert blobs[1] == bytes([4, 5, 6, 7, 104, 105, 106, 107])
    assert [bytes(f) for f in join_blocks(blobs, 2)] == [bytes(f) for f in frames]


@pytest.mark.parametrize("overrides, message", [
    ({"kv_offload_dir": "/tmp/x"}, "needs kv_offload_gib"),
    ({"kv_offload_gib": 1, "enable_prefix_caching": False}, "prefix caching"),
    ({"kv_offload_gib": -1}, ">= 0"),
])
def test_configs_that_cannot_offload_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="x", **overrides).validate()


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlap", "serial"])
def test_preempted_requests_come_back_from_the_tier_with_the_tokens_they_would_have(tiny_llama_dir, async_scheduling):
    prompts = [[(11 * i + 7 * k) % 230 + 3 for i in range(100)] for k in range(3)]  # 6 full blocks each
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)

    def run(engine: LLMEngine) -> list[list[int]]:
        for k, prompt in enumerate(prompts):
            engine.add_request(f"r{k}", prompt, long)
        finals: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finals[output.request_id] = output.outputs[0].token_ids
        return [finals[f"r{k}"] for k in range(len(prompts))]

    roomy = _engine(tiny_llama_dir, num_kv_blocks=64, kv_offload_gib=0)
    want = run(roomy)
    roomy.core.shutdown()
    # 3 x 10 blocks do not fit at once
    tight = _engine(tiny_llama_dir, num_kv_blocks=16, max_model_len=256, async_scheduling=async_scheduling)
    try:
        assert run(tight) == want
        stats = tight.stats()
        assert stats.num_preemptions > 0 and stats.kv_offload_loaded > 0
        _assert_no_leak(tight)
    finally:
        tight.core.shutdown()


def test_two_tensor_parallel_ranks_save_and_load_each_ranks_share(tiny_llama_dir, tmp_path):
    """Rank 0 gathers every rank's share of a block into the tier and sends each its share back: the answer
    is one process's, its 9 blocks loaded. A disk tier written by one process is another layout, never read."""
    single = _engine(tiny_llama_dir, kv_offload_dir=str(tmp_path))
    try:
        want, _, _ = _evict_then_ask_again(single)
    finally:
        single.core.shutdown()
    engine = _engine(tiny_llama_dir, tensor_parallel_size=2, device="cpu", kv_offload_dir=str(tmp_path))
    try:
        assert engine.core.runner.kv_layout.endswith("over 2 ranks")
        first, got, computed = _evict_then_ask_again(engine)  # the first asking computes all: the disk's is 1 rank's
        assert first == got == want
        assert computed == len(PROMPT) - 9 * BLOCK
        assert engine.stats().kv_offload_loaded == 9
        _assert_no_leak(engine)
    finally:
        engine.core.shutdown()  # and the workers
