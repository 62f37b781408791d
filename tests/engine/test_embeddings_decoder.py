"""Embeddings from a decoder (--task embed): last-token and mean pooling of the last layer's normed
hidden states equal transformers' on the same weights, and embedding requests batched with generation
on one engine change no generated token and leak no KV block."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from llmserve.engine.llm_engine import LLMEngine
from llmserve.errors import InvalidRequestError, ModelLoadError
from llmserve.llm import LLM
from llmserve.outputs import EmbeddingRequestOutput
from llmserve.sampling.params import SamplingParams

PROMPTS = [[5, 9, 13], list(range(3, 40)), [7] * 70, list(range(100, 117))]


def reference_embeddings(model_dir: Path, prompts: list[list[int]], pooling: str) -> np.ndarray:
    """transformers' last hidden states (after the final norm), pooled and normalised."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            pooled = hidden[-1] if pooling == "last" else hidden.mean(0)
            rows.append(torch.nn.functional.normalize(pooled, dim=0).numpy())
    return np.stack(rows)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_decoder_embeddings_equal_transformers(tiny_llama_dir: Path, pooling: str) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", task="embed", pooling=pooling, num_kv_blocks=64, max_model_len=256,
              max_num_batched_tokens=96)
    got = np.stack([o.outputs.data for o in llm.embed(PROMPTS)])
    np.testing.assert_allclose(got, reference_embeddings(tiny_llama_dir, PROMPTS, pooling), atol=2e-5)
    llm.engine.check_invariants()
    stats = llm.engine.stats()
    assert stats.num_used_blocks == 0 and stats.num_unfinished_requests == 0


def test_generate_only_model_refuses_embeddings(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, max_model_len=256)
    with pytest.raises(InvalidRequestError, match="does not serve embeddings") as error:
        llm.embed("hello")
    assert error.value.param == "model"


def run_all(engine: LLMEngine, requests: list[tuple[str, object]]) -> dict[str, object]:
    """Add every request (("gen", prompt) or ("emb", prompt)) and step until all finished."""
    for i, (kind, prompt) in enumerate(requests):
        if kind == "gen":
            params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
            engine.add_request(f"r{i}", prompt, params)
        else:
            engine.add_embedding_request(f"r{i}", prompt)
    done: dict[str, object] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
        engine.check_invariants()
    return done


def test_mixed_generation_and_embeddings_on_one_engine(tiny_llama_dir: Path) -> None:
    # A small KV pool and token budget, so embeddings wait for blocks and budget like everything else.
    engine = LLMEngine.from_args(
        str(tiny_llama_dir), dtype="float32", task="embed", num_kv_blocks=24, block_size=16,
        max_num_batched_tokens=80, max_model_len=128,
    )
    generations = [("gen", p) for p in PROMPTS]
    alone = run_all(engine, generations)
    steps: list[tuple[int, int]] = []  # (rows sampled, rows pooled) of each step
    schedule = engine.core.scheduler.schedule

    def recording_schedule():
        out = schedule()
        steps.append((len(out.samples), len(out.pools)))
        return out

    engine.core.scheduler.schedule = recording_schedule
    embeddings = [("emb", p) for p in PROMPTS * 3]
    mixed_requests = [item for pair in zip(embeddings[:4], generations, strict=True) for item in pair] + embeddings[4:]
    mixed = run_all(engine, mixed_requests)
    for i, (_, prompt) in enumerate(generations):
        j = mixed_requests.index(("gen", prompt))
        assert mixed[f"r{j}"].outputs[0].token_ids == alone[f"r{i}"].outputs[0].token_ids
    vectors: dict[tuple[int, ...], list[np.ndarray]] = {}
    for j, (kind, prompt) in enumerate(mixed_requests):
        if kind == "emb":
            output = mixed[f"r{j}"]
            assert isinstance(output, EmbeddingRequestOutput)
            vectors.setdefault(tuple(prompt), []).append(output.outputs.data)
    reference = reference_embeddings(tiny_llama_dir, PROMPTS, "last")
    for prompt, expected in zip(PROMPTS, reference, strict=True):
        for got in vectors[tuple(prompt)]:
            np.testing.assert_allclose(got, expected, atol=2e-5)
    assert any(sampled and pooled for sampled, pooled in steps)  # generation and embeddings in one step
    stats = engine.stats()
    assert stats.num_used_blocks == 0 and stats.num_unfinished_requests == 0
    assert stats.num_free_blocks == stats.num_blocks


def test_abort_of_a_waiting_embedding_frees_everything(tiny_llama_dir: Path) -> None:
    engine = LLMEngine.from_args(str(tiny_llama_dir), dtype="float32", task="embed", num_kv_blocks=24,
                                 max_num_batched_tokens=80, max_model_len=128)
    engine.add_embedding_request("a", PROMPTS[2])
    engine.add_embedding_request("b", PROMPTS[2])  # waits: the first fills the step's budget
    engine.step()
    assert [o.request_id for o in engine.abort_request("b")] == []  # an embedding has no partial output
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step()]
    assert finished == ["a"]
    engine.check_invariants()
    assert engine.stats().num_used_blocks == 0


def sentence_transformers_copy(model_dir: Path, out: Path, pooling_config: dict, modules: list[str]) -> Path:
    """`model_dir` laid out as a sentence-transformers checkpoint (as Qwen3-Embedding ships)."""
    shutil.copytree(model_dir, out)
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize", "Dense": "2_Dense"}
    (out / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": paths[kind], "type": f"sentence_transformers.models.{kind}"}
        for i, kind in enumerate(modules)
    ]))
    return out


def test_sentence_transformers_layout_of_a_decoder(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Its layout turns embeddings on (task auto) with its pooling; generation still works."""
    model_dir = sentence_transformers_copy(
        tiny_llama_dir, tmp_path / "st", {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False},
        ["Transformer", "Pooling", "Normalize"],
    )
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256)
    got = np.stack([o.outputs.data for o in llm.embed(PROMPTS[:2])])
    np.testing.assert_allclose(got, reference_embeddings(model_dir, PROMPTS[:2], "mean"), atol=2e-5)
    assert len(llm.generate([PROMPTS[0]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3
    dense = sentence_transformers_copy(
        tiny_llama_dir, tmp_path / "dense", {"pooling_mode_lasttoken": True}, ["Transformer", "Pooling", "Dense"]
    )
    with pytest.raises(ModelLoadError, match="Dense"):
        LLM(str(dense), dtype="float32", num_kv_blocks=64, max_model_len=256)
