"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) beyond the greedy parity with transformers that test_parity.py and
test_tensor_parallel.py prove: the router's choice and weights as transformers computes them, a checkpoint that
lacks or misshapes an expert refused naming it, Qwen2-MoE's shared expert, int8 experts (quantized at load, whole),
and what is not built for experts refused at start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve import LLM, SamplingParams
from llmserve.errors import ModelLoadError
from llmserve.model.moe import SparseMoE
from llmserve.model.quantization.int8 import quantize_int8
from tests import hf_reference


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory, tiny_llama_dir) -> Path:
    return hf_reference.build_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral"), tiny_llama_dir)


def _rewrite(src: Path, dst: Path, change) -> Path:
    """A copy of the checkpoint in `src` whose tensors `change` rewrites (a dict in, a dict out)."""
    dst.mkdir()
    for path in src.iterdir():
        if path.suffix != ".safetensors":
            (dst / path.name).write_bytes(path.read_bytes())
    save_file(change(load_file(src / "model.safetensors")), dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_the_router_picks_and_weighs_experts_as_transformers_does(mixtral_dir):
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(mixtral_dir, dtype=torch.float32)
    block = reference.model.layers[0].mlp
    llm = LLM(str(mixtral_dir), dtype="float32", num_kv_blocks=8, max_model_len=128)
    moe = llm.engine.core.runner.model.layers[0].mlp
    assert isinstance(moe, SparseMoE)
    hidden = torch.randn(9, 64)
    _, weights, chosen = block.gate(hidden)
    ours_chosen, ours_weights = moe.route(hidden)
    assert torch.equal(ours_chosen, chosen) and torch.allclose(ours_weights, weights)
    torch.testing.assert_close(moe.experts(hidden), block.experts(hidden, chosen, weights), rtol=1e-5, atol=1e-6)


def test_the_shared_expert_adds_its_gated_mlp_as_transformers_does_and_is_int8_but_its_gate(tmp_path, tiny_llama_dir):
    import transformers

    model_dir = hf_reference.build_checkpoint("qwen2-moe", tmp_path / "qwen2-moe", tiny_llama_dir)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    block = reference.model.layers[1].mlp  # `decoder_sparse_step` 2: the first layer is dense
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=8, max_model_len=128)
    moe = llm.engine.core.runner.model.layers[1].mlp
    assert isinstance(moe, SparseMoE) and not isinstance(llm.engine.core.runner.model.layers[0].mlp, SparseMoE)
    hidden = torch.randn(9, 64)
    ours = moe.experts(hidden) + moe.shared_expert(hidden)
    torch.testing.assert_close(ours, block(hidden[None])[0], rtol=1e-5, atol=1e-6)
    int8 = LLM(str(model_dir), dtype="float32", num_kv_blocks=8, max_model_len=128, quantization="int8")
    shared = int8.engine.core.runner.model.layers[1].mlp.shared_expert
    assert shared.gate_up_proj.weight.dtype == shared.down_proj.weight.dtype == torch.int8
    assert shared.gate.weight.dtype == torch.float32


def test_a_checkpoint_lacking_or_misshaping_an_expert_is_refused_naming_it(mixtral_dir, tmp_path):
    expert = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    lacking = _rewrite(mixtral_dir, tmp_path / "lacking", lambda t: {k: v for k, v in t.items() if k != expert})
    with pytest.raises(ModelLoadError, match=r"lacks 1 expert weight\(s\): layers\.1\.mlp\.experts\.3\.down"):
        LLM(str(lacking), dtype="float32", num_kv_blocks=8, max_model_len=128)
    misshapen = _rewrite(mixtral_dir, tmp_path / "misshapen", lambda t: {**t, expert: t[expert][:, :-1].clone()})
    with pytest.raises(ModelLoadError, match=r"experts\.3\.w2\.weight' has shape \(64, 159\), expected \(64, 160\)"):
        LLM(str(misshapen), dtype="float32", num_kv_blocks=8, max_model_len=128)
    config = json.loads((mixtral_dir / "config.json").read_text())
    fewer = _rewrite(mixtral_dir, tmp_path / "fewer", lambda t: t)
    (fewer / "config.json").write_text(json.dumps({**config, "num_local_experts": 3}))
    with pytest.raises(ModelLoadError, match="experts.3.w1.weight' matches no expert"):
        LLM(str(fewer), dtype="float32", num_kv_blocks=8, max_model_len=128)


def test_int8_experts_are_each_matrix_quantized_whole_and_compute_as_their_dequantized_weights(mixtral_dir, tmp_path):
    int8 = LLM(str(mixtral_dir), dtype="float32", num_kv_blocks=8, max_model_len=128, quantization="int8")
    moe = int8.engine.core.runner.model.layers[1].mlp
    assert moe.experts_gate_up.dtype == moe.experts_down.dtype == torch.int8 and moe.gate.weight.dtype == torch.float32
    tensors = load_file(mixtral_dir / "model.safetensors")
    expert = "model.layers.1.block_sparse_moe.experts.2"
    q, scale = quantize_int8(tensors[f"{expert}.w2.weight"])
    assert torch.equal(moe.experts_down[2], q) and torch.equal(moe.down_scale[2], scale)
    q, scale = quantize_int8(tensors[f"{expert}.w3.weight"])  # up: the second half of gate_up's rows
    assert torch.equal(moe.experts_gate_up[2, 160:], q) and torch.equal(moe.gate_up_scale[2, 160:], scale)

    def dequantized(weights: dict) -> dict:
        out = dict(weights)
        for name, tensor in weights.items():
            if ".experts." in name:
                q, scale = quantize_int8(tensor)
                out[name] = q.float() * scale[:, None]
        return out

    plain = LLM(str(_rewrite(mixtral_dir, tmp_path / "dequantized", dequantized)), dtype="float32", num_kv_blocks=8,
                max_model_len=128)
    reference = plain.engine.core.runner.model.layers[1].mlp
    hidden = torch.randn(7, 64)
    torch.testing.assert_close(moe.experts(hidden), reference.experts(hidden), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options, message", [
    ({"quantization": "fp8"}, "experts are quantized to int8 only, not fp8"),
    ({"enable_lora": True}, "LoRA adapters are served on generating Llama-family decoders, not on MixtralForCausalLM"),
])
def test_what_is_not_built_for_experts_is_refused_at_start(mixtral_dir, options, message):
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(mixtral_dir), dtype="float32", num_kv_blocks=8, max_model_len=128, **options)


def test_bfloat16_on_cpu_runs_the_layers_without_the_one_call_decoder(mixtral_dir):
    llm = LLM(str(mixtral_dir), dtype="bfloat16", num_kv_blocks=8, max_model_len=128)
    assert llm.engine.core.runner.cpu_decoder is None
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
