"""Built-in random-weight models: HF layout, determinism, sharding, tokenizer, transformers compatibility."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import llmserve.model.builtin as builtin
from llmserve.model.builtin import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    DEFAULT_ARCH,
    DEFAULT_SHARD_SIZE,
    DEFAULT_SIZE,
    EOS_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    PAD_TOKEN,
    QWEN3_CHAT_TEMPLATE,
    SIZES,
    build_config,
    default_model_dir,
    ensure_default_model,
    make_model,
    plan_shards,
    train_tokenizer,
    weight_shapes,
)
from llmserve.model.corpus import generate_corpus
from llmserve.tokenizer.tokenizer import Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
HF_FILES = {
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
}
PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def main():",
    "日本語 🙂",
    "1 2 3 4 5",
    "Once upon a time",
]


def _sha256_tree(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


# -- sizes and config.json ----------------------------------------------------------------------


def test_sizes_table() -> None:
    assert SIZES["tiny"] == {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 192, "vocab_size": 1024, "max_position_embeddings": 2048,
        "rope_theta": 10000.0, "torch_dtype": "float32",
    }  # fmt: skip
    assert SIZES["small"] == {
        "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 32, "intermediate_size": 704, "vocab_size": 8192, "max_position_embeddings": 4096,
        "rope_theta": 10000.0, "torch_dtype": "float32",
    }  # fmt: skip
    assert SIZES["medium"] == {
        "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 64, "intermediate_size": 2816, "vocab_size": 32000, "max_position_embeddings": 4096,
        "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    }  # fmt: skip
    assert (DEFAULT_ARCH, DEFAULT_SIZE) == ("llama", "small")


def test_tiny_llama_config(tiny_llama_dir: Path) -> None:
    config = _read_json(tiny_llama_dir / "config.json")
    assert config == {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 1019, "eos_token_id": 1020, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
        "initializer_range": 0.02, "intermediate_size": 192, "max_position_embeddings": 2048, "mlp_bias": False,
        "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "pretraining_tp": 1, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "torch_dtype": "float32", "transformers_version": "4.46.0",
        "use_cache": True, "vocab_size": 1024,
    }  # fmt: skip
    assert list(config) == sorted(config)


def test_tiny_qwen3_config(tiny_qwen3_dir: Path) -> None:
    config = _read_json(tiny_qwen3_dir / "config.json")
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["head_dim"] == 16 and config["tie_word_embeddings"] is False
    assert (config["sliding_window"], config["use_sliding_window"], config["max_window_layers"]) == (
        None,
        False,
        2,
    )


@pytest.mark.parametrize(("arch", "size"), list(itertools.product(["llama", "qwen3"], ["tiny", "small", "medium"])))
def test_config_values_per_size(arch: str, size: str) -> None:
    config = build_config(arch, size)
    spec = SIZES[size]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "max_position_embeddings", "rope_theta", "torch_dtype"):  # fmt: skip
        assert config[key] == spec[key], key
    assert config["tie_word_embeddings"] is (arch == "llama" and size == "tiny")
    assert config["rope_theta"] == (500000.0 if size == "medium" else 10000.0)
    assert (config["rms_norm_eps"], config["hidden_act"], config["rope_scaling"]) == (1e-6, "silu", None)
    assert (
        config["bos_token_id"] == spec["vocab_size"] - 5 and config["eos_token_id"] == spec["vocab_size"] - 4
    )


def test_unknown_arch_or_size() -> None:
    with pytest.raises(ValueError, match="arch"):
        build_config("gpt2", "tiny")
    with pytest.raises(ValueError, match="size"):
        build_config("llama", "huge")


def test_medium_is_about_350m_params_and_sharded() -> None:
    shapes = weight_shapes(build_config("llama", "medium"))
    params = sum(torch.Size(shape).numel() for shape in shapes.values())
    assert 330e6 < params < 370e6
    shards = plan_shards(shapes, torch.bfloat16, DEFAULT_SHARD_SIZE)
    assert len(shards) == 2
    assert [name for shard in shards for name in shard] == list(shapes)


def test_plan_shards_respects_the_limit() -> None:
    shapes = weight_shapes(build_config("qwen3", "tiny"))
    shards = plan_shards(shapes, torch.float32, 100_000)
    assert [name for shard in shards for name in shard] == list(shapes)
    for shard in shards:
        size = sum(4 * torch.Size(shapes[name]).numel() for name in shard)
        assert size <= 100_000 or len(shard) == 1


# -- files and weights --------------------------------------------------------------------------


def test_files_written(tiny_llama_dir: Path, tmp_path: Path) -> None:
    assert {p.name for p in tiny_llama_dir.iterdir()} == HF_FILES | {"model.safetensors"}
    bare = make_model(tmp_path / "bare", "llama", "small", with_weights=False)
    assert {p.name for p in bare.iterdir()} == HF_FILES


def test_generation_config(tiny_llama_dir: Path) -> None:
    assert _read_json(tiny_llama_dir / "generation_config.json") == {
        "bos_token_id": 1019,
        "do_sample": False,
        "eos_token_id": [1020, 1022],
        "transformers_version": "4.46.0",
    }


def test_qwen3_gets_the_thinking_template(tiny_qwen3_dir: Path) -> None:
    assert _read_json(tiny_qwen3_dir / "tokenizer_config.json")["chat_template"] == QWEN3_CHAT_TEMPLATE


def test_tokenizer_config(tiny_llama_dir: Path) -> None:
    config = _read_json(tiny_llama_dir / "tokenizer_config.json")
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (
        BOS_TOKEN,
        EOS_TOKEN,
        PAD_TOKEN,
    )
    assert config["chat_template"] == CHAT_TEMPLATE and config["model_max_length"] == 2048
    decoder = {int(i): entry["content"] for i, entry in config["added_tokens_decoder"].items()}
    assert decoder == {
        1019: BOS_TOKEN,
        1020: EOS_TOKEN,
        1021: IM_START_TOKEN,
        1022: IM_END_TOKEN,
        1023: PAD_TOKEN,
    }
    assert all(entry["special"] for entry in config["added_tokens_decoder"].values())
    special_map = _read_json(tiny_llama_dir / "special_tokens_map.json")
    assert (
        special_map["bos_token"]["content"] == BOS_TOKEN and special_map["pad_token"]["content"] == PAD_TOKEN
    )


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_weight_names_shapes_and_dtype(arch: str, tiny_llama_dir: Path, tiny_qwen3_dir: Path) -> None:
    path = tiny_llama_dir if arch == "llama" else tiny_qwen3_dir
    tensors = _tensors(path)
    expected = {"model.embed_tokens.weight": (1024, 64), "model.norm.weight": (64,)}
    for i in range(2):
        p = f"model.layers.{i}"
        expected |= {
            f"{p}.self_attn.q_proj.weight": (64, 64), f"{p}.self_attn.k_proj.weight": (32, 64),
            f"{p}.self_attn.v_proj.weight": (32, 64), f"{p}.self_attn.o_proj.weight": (64, 64),
            f"{p}.mlp.gate_proj.weight": (192, 64), f"{p}.mlp.up_proj.weight": (192, 64),
            f"{p}.mlp.down_proj.weight": (64, 192), f"{p}.input_layernorm.weight": (64,),
            f"{p}.post_attention_layernorm.weight": (64,),
        }  # fmt: skip
        if arch == "qwen3":
            expected |= {f"{p}.self_attn.q_norm.weight": (16,), f"{p}.self_attn.k_norm.weight": (16,)}
    if arch == "qwen3":
        expected["lm_head.weight"] = (1024, 64)
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected
    assert all(t.dtype == torch.float32 for t in tensors.values())
    norm = tensors["model.norm.weight"]
    assert not torch.equal(norm, torch.ones_like(norm)) and (norm - 1).abs().max() < 0.5
    assert torch.isfinite(torch.cat([t.flatten() for t in tensors.values()])).all()


def test_sharded_checkpoint_matches_single_file(tiny_llama_dir: Path, tmp_path: Path) -> None:
    sharded = make_model(tmp_path / "sharded", "llama", "tiny", 0, shard_size=200_000)
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in range(1, 4)]
    index = _read_json(sharded / "model.safetensors.index.json")
    single = _tensors(tiny_llama_dir)
    assert set(index["weight_map"]) == set(single) and set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in single.values())
    merged = _tensors(sharded)
    assert all(torch.equal(merged[name], single[name]) for name in single)


# -- determinism --------------------------------------------------------------------------------


def test_same_arguments_give_identical_files(tiny_llama_dir: Path, tmp_path: Path) -> None:
    again = make_model(tmp_path / "again", "llama", "tiny", 0)
    assert _sha256_tree(again) == _sha256_tree(tiny_llama_dir)
    other_seed = make_model(tmp_path / "seed1", "llama", "tiny", 1)
    hashes, other = _sha256_tree(tiny_llama_dir), _sha256_tree(other_seed)
    assert other["tokenizer.json"] == hashes["tokenizer.json"]
    assert other["model.safetensors"] != hashes["model.safetensors"]


def test_identical_in_a_fresh_process(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    """A new interpreter (new hash seed, fresh tokenizer training) writes the same bytes."""
    code = (
        "import sys; from llmserve.model.builtin import make_model; "
        "make_model(sys.argv[1], 'qwen3', 'tiny', 0)"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "m")], check=True, env=env, cwd=REPO_ROOT)
    assert _sha256_tree(tmp_path / "m") == _sha256_tree(tiny_qwen3_dir)


def test_tokenizer_training_is_deterministic() -> None:
    assert train_tokenizer.__wrapped__(1024) == train_tokenizer(1024)  # a fresh training vs the cached one
    assert generate_corpus(50, seed=3) == generate_corpus(50, seed=3)
    assert generate_corpus(50, seed=3) != generate_corpus(50, seed=4)


# -- tokenizer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", ["tiny", "small", "medium"])
def test_tokenizer_vocab_matches_config(size: str, tmp_path: Path) -> None:
    path = make_model(tmp_path / size, "llama", size, with_weights=False)
    tokenizer = Tokenizer.from_pretrained(path)
    vocab_size = SIZES[size]["vocab_size"]
    assert tokenizer.vocab_size == vocab_size
    assert [
        tokenizer.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)
    ] == list(range(vocab_size - 5, vocab_size))
    text = "héllo wörld 日本語 🙂 emoji \x00\x7f ÿ"
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids) == text
    assert "<|reserved_0|>" not in tokenizer.get_vocab()


def test_tokenizer_pipeline(tiny_llama_dir: Path) -> None:
    data = _read_json(tiny_llama_dir / "tokenizer.json")
    assert data["pre_tokenizer"] == {
        "type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True,
    }  # fmt: skip
    assert data["decoder"]["type"] == "ByteLevel" and data["model"]["type"] == "BPE"
    assert data["post_processor"]["type"] == "TemplateProcessing"
    alphabet = {token for token in data["model"]["vocab"] if len(token) == 1}
    assert len(alphabet) == 256


def test_reserved_tokens_pad_a_short_vocab(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(builtin, "generate_corpus", lambda: ["tiny corpus", "tiny tiny corpus"])
    data = json.loads(train_tokenizer.__wrapped__(300))
    contents = [entry["content"] for entry in data["added_tokens"]]
    assert len(data["model"]["vocab"]) + len(contents) == 300
    assert contents[-5:] == [BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN]
    assert contents[0] == "<|reserved_0|>" and len(contents) > 5
    assert [entry["id"] for entry in data["added_tokens"]][-1] == 299


# -- transformers compatibility -----------------------------------------------------------------


def _load_hf(path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    return model.eval()


def test_transformers_loads_llama(tiny_llama_dir: Path) -> None:
    model = _load_hf(tiny_llama_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.num_key_value_heads == 2 and model.config.head_dim == 16
    rope = getattr(model.config, "rope_parameters", None) or {"rope_theta": model.config.rope_theta}
    assert rope["rope_theta"] == 10000.0
    embed = _tensors(tiny_llama_dir)["model.embed_tokens.weight"]
    assert torch.equal(model.model.embed_tokens.weight, embed)


def test_transformers_loads_qwen3_and_shards(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    model = _load_hf(tiny_qwen3_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    sharded = _load_hf(make_model(tmp_path / "sharded", "qwen3", "tiny", 0, shard_size=150_000))
    ids = torch.tensor([[1019, 5, 77, 300]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, sharded(ids).logits)
        assert torch.equal(model.lm_head.weight, sharded.lm_head.weight)


@torch.no_grad()
def _greedy_with_margins(model: Any, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens: list[int] = []
    margins: list[float] = []
    for _ in range(steps):
        top = out.logits[0, -1].topk(2)
        margins.append(float(top.values[0] - top.values[1]))
        tokens.append(int(top.indices[0]))
        out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, margins


@pytest.mark.parametrize(("arch", "size"), [("llama", "tiny"), ("qwen3", "tiny"), ("llama", "small")])
def test_random_model_output_is_varied_with_clear_margins(arch: str, size: str, tmp_path: Path) -> None:
    path = make_model(tmp_path / "m", arch, size, 0)
    model, tokenizer = _load_hf(path), Tokenizer.from_pretrained(path)
    outputs, margins = [], []
    for prompt in PROMPTS:
        tokens, step_margins = _greedy_with_margins(model, tokenizer.encode(prompt), 32)
        outputs.append(tuple(tokens))
        margins += step_margins
    assert len(set(outputs)) == len(PROMPTS)  # the output depends on the prompt
    for tokens in outputs:
        assert len(set(tokens)) >= 8  # not one token repeated forever
        assert max(len(list(run)) for _, run in itertools.groupby(tokens)) <= 12
    margins.sort()
    assert margins[len(margins) // 2] > 1.0  # logits have a standard deviation of about 8
    assert margins[len(margins) // 20] > 0.05
    assert sum(m < 0.01 for m in margins) <= 2


# -- default model cache ------------------------------------------------------------------------


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("LLMSERVE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_model_dir() == tmp_path / "home/.cache/llmserve/models/llama-tiny-seed0"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model_dir("qwen3", "small", 3) == tmp_path / "xdg/llmserve/models/qwen3-small-seed3"
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_model_dir() == tmp_path / "explicit/models/llama-tiny-seed0"


def test_ensure_default_model_creates_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path))
    path = ensure_default_model()
    assert path == tmp_path / "models/llama-tiny-seed0"
    assert _sha256_tree(path) == _sha256_tree(tiny_llama_dir)

    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the cached model should be reused")

    monkeypatch.setattr(builtin, "make_model", fail)
    assert ensure_default_model() == path
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["llama-tiny-seed0"]


def test_ensure_default_model_refreshes_an_old_chat_template(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    """A cache written before the template learnt tools is not used with the old template (weights are kept)."""
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path))
    path = ensure_default_model()
    config_file = path / "tokenizer_config.json"
    stale = {**_read_json(config_file), "chat_template": "{{ messages[0]['content'] }}"}
    config_file.write_text(json.dumps(stale, indent=2) + "\n", encoding="utf-8")
    weights_before = (path / "model.safetensors").stat().st_mtime_ns

    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("only the metadata should be rewritten")

    monkeypatch.setattr(builtin, "make_model", fail)
    assert ensure_default_model() == path
    assert _read_json(config_file)["chat_template"] == CHAT_TEMPLATE
    assert _sha256_tree(path) == _sha256_tree(tiny_llama_dir)
    assert (path / "model.safetensors").stat().st_mtime_ns == weights_before
    assert builtin.refresh_tokenizer_metadata(path, "llama", "tiny") == []
    assert sorted(p.name for p in path.iterdir() if p.name.startswith(".")) == []


def test_ensure_default_model_race(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_llama_dir: Path
) -> None:
    monkeypatch.setenv("LLMSERVE_CACHE_DIR", str(tmp_path))
    barrier = threading.Barrier(3)
    real_make_model = builtin.make_model

    def slow_make_model(*args: Any, **kwargs: Any) -> Path:
        barrier.wait(timeout=30)  # all three build at once, then race to rename
        return real_make_model(*args, **kwargs)

    monkeypatch.setattr(builtin, "make_model", slow_make_model)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(ensure_default_model())) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [tmp_path / "models/llama-tiny-seed0"] * 3
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["llama-tiny-seed0"]
    assert _sha256_tree(results[0]) == _sha256_tree(tiny_llama_dir)


@pytest.mark.slow
def test_medium_model_is_sharded_bfloat16(tmp_path: Path) -> None:
    path = make_model(tmp_path / "medium", "llama", "medium", 0)
    index = _read_json(path / "model.safetensors.index.json")
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(set(index["weight_map"].values())) == files
    shapes = weight_shapes(build_config("llama", "medium"))
    assert set(index["weight_map"]) == set(shapes)
    assert index["metadata"]["total_size"] == 2 * sum(torch.Size(s).numel() for s in shapes.values())
    assert (path / files[0]).stat().st_size <= DEFAULT_SHARD_SIZE + 100_000
    with safe_open(str(path / files[-1]), framework="pt") as handle:
        assert handle.get_tensor("lm_head.weight").dtype == torch.bfloat16
