"""Tensor parallelism over two processes on CPU (gloo, and shared memory for small all-reduces): greedy outputs token-identical to transformers for every
decoder architecture (GQA split, MQA's one key/value head replicated, qkv bias, q/k norms), under chunked prefill
and preemption; seeded sampling the same as one process's; what it does not serve refused at start; and a worker
that dies fails the engine core, which its front end restarts (float32, random weights)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from pathlib import Path

import pytest
import torch

from llmserve.config import EngineConfig
from llmserve.engine.async_llm import AsyncLLM
from llmserve.engine.core_client import EngineCoreStartError
from llmserve.engine.messages import EngineStats, KVTransferParams
from llmserve.errors import EngineDeadError
from llmserve.model import parallel
from llmserve.model.builtin import SIZES
from llmserve.model.config import ModelConfig
from llmserve.model.dummy_weights import init_dummy_weights_
from llmserve.model.llama import LlamaForCausalLM
from llmserve.model.lora_request import LoRARequest
from llmserve.sampling.params import SamplingParams
from llmserve.server.streaming import final_outputs
from tests import hf_reference
from tests.model.test_quantization import _compressed_tensors_config, _int8_tensors, _write_checkpoint

MAX_NEW = 16


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 1024) for _ in range(rng.randint(3, 90))] for _ in range(count)]


def generate(
    model_dir: Path, batch: list[list[int]], params: list[SamplingParams], **config
) -> tuple[list[list[int]], EngineStats]:
    """Each prompt's output tokens, and the engine's stats at the end."""

    async def run() -> tuple[list[list[int]], EngineStats]:
        engine = AsyncLLM.from_config(EngineConfig(model=str(model_dir), dtype="float32", **{"device": "cpu", **config}))
        try:
            streams = [await engine.add_request(f"r{i}", prompt, p) for i, (prompt, p) in
                       enumerate(zip(batch, params, strict=True))]
            outputs = await final_outputs(streams)
            stats = await engine.stats()
            assert stats.num_running == stats.num_waiting == stats.num_used_blocks == 0  # no leaked block
            await engine.check_invariants()
            return [output.outputs[0].token_ids for output in outputs], stats
        finally:
            engine.close()

    return asyncio.run(run())


# GQA with a kv head a rank and q/k norms (qwen3), an MQA head every rank holds (llama-linear-mqa), a bias on q/k/v
# and experts with a shared expert split by features (qwen2-moe)
@pytest.mark.parametrize("case", ["llama-linear-mqa", "qwen3", "qwen2-moe"])
def test_two_ranks_match_transformers(case: str, tmp_path: Path, tiny_llama_dir: Path) -> None:
    model_dir = hf_reference.build_checkpoint(case, tmp_path / case, tiny_llama_dir)
    reference = hf_reference.load_model(model_dir)
    batch = prompts(10, seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    # a 32-token step budget (prompts take several chunks) and 20 blocks for 10 sequences of up to 106 tokens:
    # sequences are preempted and computed again
    outputs, stats = generate(model_dir, batch, [greedy] * len(batch), tensor_parallel_size=2,
                              num_kv_blocks=20, max_num_batched_tokens=32, max_model_len=256)
    assert stats.num_preemptions > 0
    assert outputs == [hf_reference.greedy(reference, prompt, MAX_NEW) for prompt in batch]


def test_seeded_sampling_is_the_same_as_one_process(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """Each rank samples for itself: had rank 1 drawn other tokens, its KV cache (and so the sum of every
    layer) would have gone another way."""
    model_dir = hf_reference.build_checkpoint("llama", tmp_path / "llama", tiny_llama_dir)
    batch = prompts(6, seed=6)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=MAX_NEW, ignore_eos=True)
              for i in range(len(batch))]
    one, _ = generate(model_dir, batch, params, num_kv_blocks=64)
    two, _ = generate(model_dir, batch, params, num_kv_blocks=64, tensor_parallel_size=2)
    assert two == one
    assert len({tuple(tokens) for tokens in one}) == len(batch)


def test_int8_weights_over_two_ranks_give_one_ranks_tokens(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """Quantized at load (each weight quantized whole, then split) and read from a compressed-tensors int8
    checkpoint: the quantized values one rank holds, so the same greedy tokens (float32)."""
    batch = prompts(6, seed=9)
    greedy = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)] * len(batch)
    one, _ = generate(tiny_llama_dir, batch, greedy, num_kv_blocks=64, quantization="int8", max_model_len=256)
    at_load, _ = generate(tiny_llama_dir, batch, greedy, num_kv_blocks=64, quantization="int8", tensor_parallel_size=2,
                          max_model_len=256)
    checkpoint = _write_checkpoint(tiny_llama_dir, tmp_path / "int8", _compressed_tensors_config("int", "int-quantized"),
                                   _int8_tensors)
    prequantized, _ = generate(checkpoint, batch, greedy, num_kv_blocks=64, tensor_parallel_size=2, max_model_len=256)
    assert at_load == prequantized == one
    moe = hf_reference.build_checkpoint("qwen2-moe", tmp_path / "moe", tiny_llama_dir)  # int8 experts, split by features
    int8 = dict(num_kv_blocks=64, quantization="int8", max_model_len=256)
    assert generate(moe, batch, greedy, tensor_parallel_size=2, **int8)[0] == generate(moe, batch, greedy, **int8)[0]


def test_speculation_and_an_int8_kv_cache_over_two_ranks(tmp_path: Path, tiny_llama_dir: Path,
                                                         cycling_llama_dir: Path) -> None:
    """N-gram drafts and a draft model's verified on every rank (a model that repeats cycles of tokens, so drafts
    hold): one rank's tokens without drafts; an int8 KV cache (each rank's heads quantized on their own): one rank's tokens."""
    batch = prompts(4, seed=10)
    greedy = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)] * len(batch)
    plain, _ = generate(cycling_llama_dir, batch, greedy, num_kv_blocks=128, max_model_len=512)
    speculating, stats = generate(cycling_llama_dir, batch, greedy, num_kv_blocks=128, max_model_len=512,
                                  tensor_parallel_size=2, speculative_config={
                                      "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                      "prompt_lookup_min": 2})
    assert speculating == plain
    assert stats.spec_decode is not None and stats.spec_decode.num_accepted_tokens > 0
    # A draft model, whole on rank 0 beside the split served model (here the served model drafting for itself).
    drafted, stats = generate(cycling_llama_dir, batch, greedy, num_kv_blocks=128, max_model_len=512,
                              tensor_parallel_size=2, speculative_config={
                                  "model": str(cycling_llama_dir), "num_speculative_tokens": 3})
    assert drafted == plain
    assert stats.spec_decode is not None and stats.spec_decode.num_accepted_tokens == stats.spec_decode.num_draft_tokens > 0
    model_dir = hf_reference.build_checkpoint("llama", tmp_path / "llama", tiny_llama_dir)
    int8_kv = dict(num_kv_blocks=128, max_model_len=512, kv_cache_dtype="int8")
    assert generate(model_dir, batch, greedy, tensor_parallel_size=2, **int8_kv)[0] == generate(
        model_dir, batch, greedy, **int8_kv)[0]


@pytest.mark.parametrize("max_loras", [1, 2])
def test_lora_adapters_over_two_ranks_match_peft(tmp_path: Path, tiny_llama_dir: Path, max_loras: int) -> None:
    """Two adapters and none in one batch, each rank holding its share of each adapter (MQA: the one key/value
    head, replicated, adapted on both); with one slot the ranks swap adapters in and out alike."""
    base = hf_reference.build_checkpoint("llama-linear-mqa", tmp_path / "base", tiny_llama_dir)
    adapters = {
        "every": hf_reference.build_lora_adapter(base, tmp_path / "every", rank=8, alpha=16, seed=1),
        "some": hf_reference.build_lora_adapter(base, tmp_path / "some", targets=("q_proj", "v_proj", "down_proj"),
                                                rank=4, alpha=8, seed=2, rslora=True),
    }
    references = {None: hf_reference.load_model(base)} | {
        name: hf_reference.load_with_adapter(base, path) for name, path in adapters.items()}
    requests = {None: None} | {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
    cases = [(prompt, name) for prompt in prompts(3, seed=11) for name in references]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)

    async def run() -> list[list[int]]:
        engine = AsyncLLM.from_config(EngineConfig(
            model=str(base), dtype="float32", device="cpu", tensor_parallel_size=2, num_kv_blocks=128,
            max_model_len=256, enable_lora=True, max_loras=max_loras, max_lora_rank=8))
        try:
            streams = [await engine.add_request(f"r{i}", prompt, greedy, lora_request=requests[name])
                       for i, (prompt, name) in enumerate(cases)]
            return [output.outputs[0].token_ids for output in await final_outputs(streams)]
        finally:
            engine.close()

    assert asyncio.run(run()) == [hf_reference.greedy(references[name], prompt, MAX_NEW) for prompt, name in cases]


def test_weights_reloaded_on_every_rank(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """A reload while serving: after it, transformers' greedy tokens on the new checkpoint (each rank read its
    share), with the prefix cache of the old weights forgotten."""
    old = hf_reference.build_checkpoint("llama", tmp_path / "old", tiny_llama_dir, seed=0)
    new = hf_reference.build_checkpoint("llama", tmp_path / "new", tiny_llama_dir, seed=1)
    prompt = prompts(1, seed=12)[0]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)

    async def run() -> tuple[list[int], list[int], int]:
        engine = AsyncLLM.from_config(EngineConfig(model=str(old), dtype="float32", device="cpu",
                                                   tensor_parallel_size=2, num_kv_blocks=64, max_model_len=256))
        try:
            [before] = await final_outputs([await engine.add_request("before", prompt, greedy)])
            forgotten = await engine.reload_weights(new)
            [after] = await final_outputs([await engine.add_request("after", prompt, greedy)])
            return before.outputs[0].token_ids, after.outputs[0].token_ids, forgotten
        finally:
            engine.close()

    before, after, forgotten = asyncio.run(run())
    assert before == hf_reference.greedy(hf_reference.load_model(old), prompt, MAX_NEW)
    assert after == hf_reference.greedy(hf_reference.load_model(new), prompt, MAX_NEW) != before
    assert forgotten > 0


def test_kv_pulled_between_two_tensor_parallel_engines_gives_the_prefill_engines_answer(
    tmp_path: Path, tiny_llama_dir: Path,
) -> None:
    """Disaggregation with both engines over two ranks: the prefill engine's serving thread has its step loop read
    the held blocks (rank 0 gathering every rank's share), and the decode engine's rank 0 sends each rank its share
    of the pulled blocks; the answer is the one the prefill engine gives by itself."""
    model_dir = hf_reference.build_checkpoint("llama", tmp_path / "llama", tiny_llama_dir)
    prompt = [(7 * i + 3) % 250 + 1 for i in range(150)]  # 9 full blocks of 16 and 6 tokens
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    first_token = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    async def run() -> None:
        config = dict(model=str(model_dir), dtype="float32", device="cpu", tensor_parallel_size=2, kv_transfer=True,
                      kv_transfer_host="127.0.0.1", num_kv_blocks=64, max_model_len=512, block_size=16)
        prefill, decode = AsyncLLM.from_config(EngineConfig(**config)), AsyncLLM.from_config(EngineConfig(**config))
        try:
            (alone,) = await final_outputs([await prefill.add_request("alone", prompt, greedy)])
            held = KVTransferParams(do_remote_decode=True)
            (exported,) = await final_outputs([await prefill.add_request("p", prompt, first_token, kv_transfer=held)])
            where = exported.kv_transfer_params
            assert where is not None and where["num_tokens"] == 9 * 16
            remote = KVTransferParams(do_remote_prefill=True, transfer_id=where["transfer_id"],
                                      remote_host="127.0.0.1", remote_port=where["remote_port"])
            (answer,) = await final_outputs([await decode.add_request("d", prompt, greedy, kv_transfer=remote)])
            assert answer.outputs[0].token_ids == alone.outputs[0].token_ids
            received, sent = await decode.stats(), await prefill.stats()
            assert (received.kv_blocks_received, received.kv_pulls_failed, sent.kv_blocks_sent) == (9, 0, 9)
            for engine in (prefill, decode):
                await engine.check_invariants()
        finally:
            prefill.close()
            decode.close()

    asyncio.run(run())


def test_heads_the_ranks_cannot_divide_are_refused(tmp_path: Path, tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be at least 1"):
        EngineConfig(model=str(tiny_llama_dir), tensor_parallel_size=0).validate()
    model_dir = hf_reference.build_checkpoint("llama", tmp_path / "llama", tiny_llama_dir)  # 4 heads, 2 kv heads
    with pytest.raises(EngineCoreStartError, match="needs the attention heads divisible by 3"):
        AsyncLLM.from_config(EngineConfig(model=str(model_dir), dtype="float32", device="cpu", tensor_parallel_size=3))


def test_dummy_weights_whole_on_every_rank_are_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--load-format dummy` split over ranks: the embeddings and the head, drawn after split matrices of another
    size on each rank, come out the same on every rank (each rank's draws, as two processes would make them)."""
    config = ModelConfig.from_dict(SIZES["tiny"] | {"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False})
    drawn = []
    for rank in range(2):
        monkeypatch.setattr(parallel._group, "rank", rank)
        monkeypatch.setattr(parallel._group, "size", 2)
        model = LlamaForCausalLM(config)
        init_dummy_weights_(model, seed=3)
        drawn.append(dict(model.named_parameters()))
    assert torch.equal(drawn[0]["embed_tokens.weight"], drawn[1]["embed_tokens.weight"])
    assert torch.equal(drawn[0]["lm_head.weight"], drawn[1]["lm_head.weight"])
    qkv = drawn[0]["layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape[0] == (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim // 2
    assert qkv.std() > 0


def test_a_worker_that_dies_fails_the_core_which_comes_back(tmp_path: Path, tiny_llama_dir: Path) -> None:
    model_dir = hf_reference.build_checkpoint("llama", tmp_path / "llama", tiny_llama_dir)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    prompt = prompts(1, seed=7)[0]
    expected = hf_reference.greedy(hf_reference.load_model(model_dir), prompt, MAX_NEW)

    async def run() -> None:
        engine = AsyncLLM.from_config(EngineConfig(model=str(model_dir), dtype="float32", device="cpu",
                                                   tensor_parallel_size=2, num_kv_blocks=64))
        try:
            first_core = engine.engine_core_pid
            [worker] = workers_of(first_core)
            os.kill(worker, signal.SIGKILL)
            stream = await engine.add_request("doomed", prompt, greedy)
            with pytest.raises(EngineDeadError):  # its step's collective finds the worker gone
                await final_outputs([stream])
            while not engine.is_healthy:  # as a load balancer's health check would poll
                await asyncio.sleep(0.05)
            assert engine.num_restarts == 1 and engine.engine_core_pid != first_core
            assert len(workers_of(engine.engine_core_pid)) == 1
            [output] = await final_outputs([await engine.add_request("after", prompt, greedy)])
            assert output.outputs[0].token_ids == expected
        finally:
            engine.close()

    asyncio.run(run())


def workers_of(core_pid: int | None) -> list[int]:
    """The engine core's child processes: its tensor-parallel workers."""
    assert core_pid is not None
    children = Path(f"/proc/{core_pid}/task/{core_pid}/children").read_text().split()
    return [int(pid) for pid in children if b"parallel_runner" in Path(f"/proc/{pid}/cmdline").read_bytes()]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_give_what_one_gives(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """NCCL between two GPUs (the CPU tests above run gloo): the same greedy tokens as one GPU, float32."""
    model_dir = hf_reference.build_checkpoint("qwen2", tmp_path / "qwen2", tiny_llama_dir)
    batch = prompts(8, seed=8)
    greedy = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)] * len(batch)
    one, _ = generate(model_dir, batch, greedy, device="cuda", num_kv_blocks=64)
    two, _ = generate(model_dir, batch, greedy, device="cuda", num_kv_blocks=64, tensor_parallel_size=2)
    assert two == one
