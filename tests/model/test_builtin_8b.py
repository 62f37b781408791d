"""`make-model --size 8b`: Llama-3.1-8B's configuration and a local tokenizer, no weights by default, and
an engine that starts from it with `load_format="dummy"` (random weights in place, no float32 detour)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from llmserve import LLM, SamplingParams
from llmserve.cli import main
from llmserve.model.builtin import build_config, build_generation_config, checkpoint_bytes, make_model
from llmserve.model.config import ModelConfig
from llmserve.model.dummy_weights import DUMMY_PERIOD, init_dummy_weights_
from llmserve.model.llama import LlamaForCausalLM

LLAMA_31_8B_PARAMS = 8_030_261_248
HF_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json"}


@pytest.fixture(scope="module")
def llama_8b_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("llama-8b"), "llama", "8b")


def test_8b_config_is_llama_31_8b() -> None:
    assert build_config("llama", "8b") == {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-5,
        "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.46.0", "use_cache": True, "vocab_size": 128256,
    }  # fmt: skip
    assert build_generation_config("8b")["eos_token_id"] == [128001, 128008, 128009]
    with pytest.raises(ValueError, match="llama model"):
        build_config("qwen3", "8b")


def test_8b_shape_counts() -> None:
    config = build_config("llama", "8b")
    model_config = ModelConfig.from_dict(config)
    assert model_config.num_parameters() == LLAMA_31_8B_PARAMS
    assert checkpoint_bytes(config) == 2 * LLAMA_31_8B_PARAMS
    assert model_config.kv_bytes_per_token(torch.bfloat16) == 2 * 32 * 8 * 128 * 2
    rope = model_config.rope
    assert (rope.rope_type, rope.factor, rope.low_freq_factor, rope.high_freq_factor) == ("llama3", 8.0, 1.0, 4.0)
    assert (rope.theta, rope.original_max_position_embeddings) == (500000.0, 8192)


def test_make_model_8b_writes_config_and_tokenizer_only(llama_8b_dir: Path) -> None:
    assert {p.name for p in llama_8b_dir.iterdir()} == HF_FILES
    assert json.loads((llama_8b_dir / "config.json").read_text()) == build_config("llama", "8b")
    tokenizer = json.loads((llama_8b_dir / "tokenizer.json").read_text())
    assert max(tokenizer["model"]["vocab"].values()) < 32000
    assert max(t["id"] for t in tokenizer["added_tokens"]) == 31999
    assert json.loads((llama_8b_dir / "tokenizer_config.json").read_text())["model_max_length"] == 131072


def test_transformers_reads_the_8b_config(llama_8b_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(llama_8b_dir)
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (4096, 32, 8)
    scaling = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", {})
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0


class _OutputRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[tuple[str, torch.dtype, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.outputs += [(str(func), t.dtype, t.device.type) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def test_full_8b_model_has_llama_31_8b_parameters() -> None:
    config = ModelConfig.from_dict(build_config("llama", "8b"))
    with torch.device("meta"):  # shapes only: the full 32 layers without 16 GB
        model = LlamaForCausalLM(config, max_positions=4096)
    assert sum(p.numel() for p in model.parameters()) == LLAMA_31_8B_PARAMS
    init_dummy_weights_(model, seed=0)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_dummy_init_fills_in_place_in_the_target_dtype(tiny_llama_dir: Path) -> None:
    config = ModelConfig.from_pretrained(tiny_llama_dir)
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config, max_positions=64)
    with _OutputRecorder() as recorder:
        init_dummy_weights_(model, seed=0)
    assert {(dtype, device) for _, dtype, device in recorder.outputs} == {(torch.bfloat16, "cpu")}
    ops = {op for op, _, _ in recorder.outputs}
    assert ops <= {"aten.normal_.default", "aten.fill_.Scalar", "aten.view.default", "aten.slice.Tensor",
                   "aten.copy_.default"}, ops  # nothing allocated, nothing converted


def test_dummy_fill_repeats_one_prime_period_block() -> None:
    flat = torch.empty(2 * DUMMY_PERIOD + 10, dtype=torch.bfloat16)
    init_dummy_weights_(nn.ParameterList([nn.Parameter(flat.view(-1, 1), requires_grad=False)]), seed=1)
    block = flat[:DUMMY_PERIOD]
    assert torch.equal(flat[DUMMY_PERIOD : 2 * DUMMY_PERIOD], block) and torch.equal(flat[-10:], block[:10])
    assert block.float().std().item() == pytest.approx(0.02, rel=0.02)
    assert block.unique().numel() > 1000


def test_engine_starts_from_a_config_only_8b_shrunk_in_layers(llama_8b_dir: Path, tmp_path: Path) -> None:
    shrunk = tmp_path / "llama-8b-1-layer"
    shrunk.mkdir()
    for path in llama_8b_dir.iterdir():
        (shrunk / path.name).write_bytes(path.read_bytes())
    config = json.loads((shrunk / "config.json").read_text())
    (shrunk / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))

    llm = LLM(str(shrunk), load_format="dummy", device="cpu", max_model_len=128, num_kv_blocks=16)
    engine = llm.engine
    model = engine.core.runner.model
    assert engine.core.runner.dtype == torch.bfloat16  # the checkpoint's dtype on CPU
    assert model.lm_head.weight.shape == (128256, 4096) and model.lm_head.weight.dtype == torch.bfloat16
    embed = model.embed_tokens.weight
    assert embed[:1000].float().std().item() == pytest.approx(0.02, rel=0.05)
    assert not torch.equal(embed[0], embed[1])
    assert torch.equal(model.norm.weight, torch.ones(4096, dtype=torch.bfloat16))
    assert {128001, 128008, 128009} <= engine.facts.eos_token_ids
    out = llm.generate([list(range(100, 120))], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert all(0 <= t < 128256 for t in out[0].outputs[0].token_ids)


def test_cli_make_model_8b(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    assert main(["make-model", str(tmp_path / "cfg"), "--size", "8b"]) == 0
    assert "config and tokenizer only" in capsys.readouterr().out
    assert not list((tmp_path / "cfg").glob("*.safetensors"))
    assert main(["make-model", str(tmp_path / "q"), "--size", "8b", "--arch", "qwen3"]) == 2
    assert "no 'qwen3' variant" in capsys.readouterr().err

    calls: list[dict] = []
    monkeypatch.setattr("llmserve.model.builtin.make_model", lambda out, **kw: calls.append(kw) or Path(out))
    assert main(["make-model", str(tmp_path / "w"), "--size", "8b", "--with-weights"]) == 0
    assert calls == [{"arch": "llama", "size": "8b", "seed": 0, "with_weights": True}]
    assert "warning: writing 16.1 GB of random weights" in capsys.readouterr().err
    assert main(["make-model", str(tmp_path / "t"), "--size", "tiny"]) == 0
    assert calls[-1]["with_weights"] is True
