"""LoRA adapters in PEFT's layout: greedy tokens identical to PEFT's model over transformers (float32, random
weights and random A and B) for adapters of every linear layer and of a few, rsLoRA's scale, a smaller rank than
the slots hold, and the base model, all in one batch under chunked prefill and prefix caching; with one adapter
slot the scheduler takes the adapters' requests in turn. Adapters that cannot be served are refused by name."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve import LLM, LoRARequest, SamplingParams
from llmserve.errors import InvalidRequestError
from llmserve.model.config import ModelConfig
from llmserve.model.lora import AdapterChecker, LoRAAdapterError
from tests import hf_reference

MAX_NEW = 16


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = hf_reference.build_checkpoint("llama", root / "base", tiny_llama_dir)
    return {
        "base": base,
        "every": hf_reference.build_lora_adapter(base, root / "every", rank=8, alpha=16, seed=1),
        "some": hf_reference.build_lora_adapter(base, root / "some", targets=("q_proj", "v_proj", "down_proj"),
                                                rank=4, alpha=8, seed=2, rslora=True),
    }


@pytest.fixture(scope="module")
def prompts_and_references(adapters) -> list[tuple[list[int], str | None, list[int]]]:
    """(prompt, adapter, PEFT's greedy tokens): each prompt once with each adapter and without one."""
    rng = random.Random(4)
    prompts = [[rng.randrange(2, 1024) for _ in range(rng.randint(20, 70))] for _ in range(3)]
    references = {None: hf_reference.load_model(adapters["base"])}
    for name in ("every", "some"):
        references[name] = hf_reference.load_with_adapter(adapters["base"], adapters[name])
    return [(prompt, name, hf_reference.greedy(model, prompt, MAX_NEW))
            for prompt in prompts for name, model in references.items()]


@pytest.mark.parametrize("max_loras", [1, 2])
def test_adapters_in_one_batch_match_peft(adapters, prompts_and_references, max_loras):
    llm = LLM(str(adapters["base"]), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=32,
              enable_lora=True, max_loras=max_loras, max_lora_rank=8)
    requests = {name: LoRARequest(name, i + 1, str(adapters[name])) for i, name in enumerate(("every", "some"))}
    prompts = [prompt for prompt, _, _ in prompts_and_references]
    loras = [requests.get(name) for _, name, _ in prompts_and_references]  # type: ignore[arg-type]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), lora_request=loras)
    for out, (_, name, expected) in zip(outs, prompts_and_references, strict=True):
        assert out.outputs[0].token_ids == expected, name
    assert len({tuple(e) for p, _, e in prompts_and_references if p == prompts[0]}) == 3  # adapters change tokens
    # The same prompts again: each adapter's prefix is cached apart from the others' and the base's.
    again = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), lora_request=loras)
    assert [o.outputs[0].token_ids for o in again] == [e for _, _, e in prompts_and_references]
    assert all(o.num_cached_tokens > 0 for o in again)
    llm.engine.check_invariants()
    assert llm.engine.core.block_manager.num_free_blocks == 64


def test_a_request_whose_adapter_went_missing_fails_alone(adapters, tmp_path):
    moved = shutil.copytree(adapters["some"], tmp_path / "moved")
    llm = LLM(str(adapters["base"]), dtype="float32", num_kv_blocks=64, enable_lora=True)
    lora = LoRARequest("moved", 1, str(moved))
    llm.engine.input_processor.check_lora(lora)  # checked, then gone before a request reads it
    shutil.rmtree(moved)
    failed, served = llm.generate([[5, 6, 7], [8, 9, 10]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                                  lora_request=[lora, None])
    assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].token_ids == []
    assert served.outputs[0].finish_reason == "length" and len(served.outputs[0].token_ids) == 4
    with pytest.raises(InvalidRequestError, match="lora_int_id 1 already names"):
        llm.generate([[5]], lora_request=LoRARequest("other", 1, str(adapters["every"])))
    llm.engine.check_invariants()
    assert llm.engine.core.block_manager.num_free_blocks == 64


def test_stats_name_the_adapters_running_and_waiting(adapters):
    """vLLM's lora_requests_info: with one slot, the second adapter's request waits while the first runs."""
    engine = LLM(str(adapters["base"]), dtype="float32", num_kv_blocks=64, enable_lora=True).engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, name in enumerate(("every", "some")):
        engine.add_request(name, [5, 6, 7], params, lora_request=LoRARequest(name, i + 1, str(adapters[name])))
    engine.step()
    stats = engine.stats()
    assert (stats.running_loras, stats.waiting_loras) == (["every"], ["some"])
    while engine.has_unfinished_requests():
        engine.step()
    assert (engine.stats().running_loras, engine.stats().waiting_loras) == ([], [])


def test_an_engine_without_lora_refuses_adapters(adapters):
    llm = LLM(str(adapters["base"]), dtype="float32", num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        llm.generate([[5, 6]], lora_request=LoRARequest("every", 1, str(adapters["every"])))


def _edited(source: Path, out: Path, config: dict | None = None, weights=None) -> Path:
    shutil.copytree(source, out)
    if config is not None:
        path = out / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if weights is not None:
        path = out / "adapter_model.safetensors"
        save_file(weights(load_file(path)), path)
    return out


def test_adapters_that_cannot_be_served_are_refused_by_name(adapters, tmp_path):
    checker = AdapterChecker(ModelConfig.from_pretrained(adapters["base"]), max_rank=8)
    every = adapters["every"]
    cases = {
        "over the server's maximum LoRA rank 4": (every, 4),
        "No adapter_config.json": (tmp_path / "nowhere", 8),
        "`use_dora`": (_edited(every, tmp_path / "dora", {"use_dora": True}), 8),
        "`modules_to_save`": (_edited(every, tmp_path / "saved", {"modules_to_save": ["lm_head"]}), 8),
        "embedding and lm_head adapters are not supported": (_edited(every, tmp_path / "embed", weights=lambda w: {
            **w, "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 1024)}), 8),
        "this model needs A": (_edited(every, tmp_path / "shape", weights=lambda w: {
            name: t[:, :32].contiguous() if name.endswith("layers.0.self_attn.q_proj.lora_A.weight") else t
            for name, t in w.items()}), 8),
        "has only one of lora_A and lora_B": (_edited(every, tmp_path / "half", weights=lambda w: {
            name: t for name, t in w.items() if "layers.1.mlp.up_proj.lora_B" not in name}), 8),
    }
    for i, (message, (path, max_rank)) in enumerate(cases.items()):
        checker.max_rank = max_rank
        with pytest.raises(LoRAAdapterError, match=message) as caught:
            checker.check(LoRARequest(f"case{i}", i + 1, str(path)))
        assert caught.value.param == "lora_path"
    assert checker.checked == {}
