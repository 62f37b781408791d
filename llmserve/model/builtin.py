"""Built-in random-weight models written as Hugging Face checkpoints.

`make_model` writes a directory that both llmserve and `transformers` can load: `config.json`,
`generation_config.json`, the weights as safetensors (sharded with an index when they are larger
than a shard), and a byte-level BPE tokenizer trained on a corpus generated in code. Everything is
a pure function of the arguments, so the same call always produces byte-identical files.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from llmserve.model.corpus import generate_corpus

DEFAULT_ARCH = "llama"
DEFAULT_SIZE = "small"
DEFAULT_SHARD_SIZE = 512 * 1024 * 1024
TRANSFORMERS_VERSION = "4.46.0"

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, PAD_TOKEN)

_TOOLS_INTRO = (
    "# Tools\\n\\nYou can call the functions whose signatures are listed in JSON within <tools></tools>:\\n<tools>"
)
_TOOLS_OUTRO = (
    "\\n</tools>\\n\\nTo call functions, write one JSON object per call, with the function name and its"
    " arguments, each within <tool_call></tool_call> tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call>'
)


def _chat_template(thinking: bool) -> str:
    """ChatML, with tools in the Hermes/Qwen format: a `<tools>` block in the system turn, assistant calls as
    `<tool_call>` JSON, tool results as `<tool_response>` blocks in a user turn. Without tools, tool calls
    or tool results, the text is plain ChatML. `thinking` adds Qwen3's handling of `<think>`: an assistant turn's
    reasoning (its `reasoning_content`, else what its content has before `</think>`) is dropped from the turns
    before the last user message and kept in those after it (a tool loop's), and `enable_thinking=False` closes an
    empty think block in the generation prompt."""
    last_question = (
        "{% set ns = namespace(last_question=-1) %}"
        "{% for message in messages %}{% if message['role'] == 'user' %}{% set ns.last_question = loop.index0 %}"
        "{% endif %}{% endfor %}"
        if thinking
        else ""
    )
    strip_reasoning = (
        "{% set reasoning = message['reasoning_content'] if message['reasoning_content'] is string else '' %}"
        "{% if message['role'] == 'assistant' and '</think>' in content %}"
        "{% if not reasoning %}{% set reasoning = content.split('</think>')[0].split('<think>')[-1] %}{% endif %}"
        "{% set content = content.split('</think>')[-1].lstrip('\\n') %}"
        "{% endif %}"
        "{% if message['role'] == 'assistant' and reasoning and loop.index0 > ns.last_question %}"
        "{% set content = '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content %}"
        "{% endif %}"
        if thinking
        else ""
    )
    empty_think = (
        "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
        if thinking
        else ""
    )
    return (
        "{{ bos_token }}"
        f"{last_question}"
        "{% if tools %}"
        "{{ '<|im_start|>system\\n' }}"
        "{% if messages and messages[0]['role'] == 'system' and messages[0]['content'] is string %}"
        "{{ messages[0]['content'] + '\\n\\n' }}"
        "{% endif %}"
        f"{{{{ \"{_TOOLS_INTRO}\" }}}}"
        "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
        f"{{{{ \"{_TOOLS_OUTRO}\" + '<|im_end|>\\n' }}}}"
        "{% endif %}"
        "{% for message in messages %}"
        "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
        "{{ raise_exception('Unknown message role: ' + message['role']) }}"
        "{% endif %}"
        "{% set content = message['content'] if message['content'] is string else '' %}"
        f"{strip_reasoning}"
        "{% if tools and loop.first and message['role'] == 'system' %}"
        "{% elif message['role'] == 'tool' %}"
        "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
        "{{ '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
        "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
        "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
        "{{ '<|im_start|>assistant' }}"
        "{% if content %}{{ '\\n' + content }}{% endif %}"
        "{% for tool_call in message['tool_calls'] %}"
        "{% set function = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
        "{{ '\\n<tool_call>\\n{\"name\": ' + (function['name'] | tojson) + ', \"arguments\": '"
        " + (function['arguments'] | tojson) + '}\\n</tool_call>' }}"
        "{% endfor %}"
        "{{ '<|im_end|>\\n' }}"
        "{% else %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
        "{% endif %}"
        "{% endfor %}"
        f"{{% if add_generation_prompt %}}{{{{ '<|im_start|>assistant\\n' }}}}{empty_think}{{% endif %}}"
    )


CHAT_TEMPLATE = _chat_template(thinking=False)
QWEN3_CHAT_TEMPLATE = _chat_template(thinking=True)
CHAT_TEMPLATES: dict[str, str] = {"llama": CHAT_TEMPLATE, "qwen3": QWEN3_CHAT_TEMPLATE}

SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 192,
        "vocab_size": 1024,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
    },
    "small": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 32,
        "intermediate_size": 704,
        "vocab_size": 8192,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
    },
    "medium": {
        "hidden_size": 1024,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 2816,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
    },
    # Llama-3.1-8B's shape, for GPU benchmarks: its other settings are in REAL_MODEL_SETTINGS.
    "8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
    },
}

# Sizes that copy a released model: config.json fields that differ from the built-in defaults (the
# released special token ids among them), and the generation_config.json eos ids.
REAL_MODEL_SETTINGS: dict[str, dict[str, Any]] = {
    "8b": {
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "rms_norm_eps": 1e-5,
        "rope_scaling": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": False,
    },
}
REAL_MODEL_ARCH: dict[str, str] = {"8b": "llama"}
# The tokenizer is trained locally for every size; for the 8b it is smaller than the embedding (the
# extra rows are simply never produced by the tokenizer).
TOKENIZER_VOCAB_SIZES: dict[str, int] = {"8b": 32000}
SIZES_WITHOUT_DEFAULT_WEIGHTS: frozenset[str] = frozenset({"8b"})  # 16 GB: pair with --load-format dummy

ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Init scales, chosen (and checked against transformers) so that a random model's greedy output
# depends on the prompt, does not collapse to one repeated token, and has clear top-1/top-2 logit
# margins (logits have a standard deviation of about 8). Linear layers get std = GAIN / sqrt(fan_in).
# The output projections (o_proj, down_proj) are strong so that each layer's contribution outweighs
# the token's own embedding in the residual stream: with tied embeddings a weak residual update
# makes the model predict its current token again and again.
EMBED_STD = 1.0
LINEAR_GAIN = 1.0
QK_GAIN = 2.0
OUT_GAIN = 8.0
LM_HEAD_GAIN = 8.0
NORM_NOISE_STD = 0.1


# ---------------------------------------------------------------------------------------------
# config files
# ---------------------------------------------------------------------------------------------


def special_token_ids(vocab_size: int) -> dict[str, int]:
    """The ids of the named special tokens: they are the last ids of the vocabulary."""
    first = vocab_size - len(SPECIAL_TOKENS)
    return {token: first + index for index, token in enumerate(SPECIAL_TOKENS)}


def _size_spec(size: str) -> dict[str, Any]:
    if size not in SIZES:
        raise ValueError(f"unknown built-in model size {size!r}; choose one of {sorted(SIZES)}")
    return SIZES[size]


def _arch_name(arch: str) -> str:
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown built-in model arch {arch!r}; choose one of {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[arch]


def _check_arch_for_size(arch: str, size: str) -> None:
    required = REAL_MODEL_ARCH.get(size)
    if required is not None and arch != required:
        raise ValueError(f"built-in size {size!r} is a {required} model; it has no {arch!r} variant")


def tokenizer_vocab_size(size: str) -> int:
    """How many tokens the size's locally trained tokenizer has."""
    return TOKENIZER_VOCAB_SIZES.get(size, _size_spec(size)["vocab_size"])


def build_config(arch: str, size: str) -> dict[str, Any]:
    """config.json as a plain dict, in the layout transformers 4.x writes."""
    spec = _size_spec(size)
    _check_arch_for_size(arch, size)
    ids = special_token_ids(spec["vocab_size"])
    config: dict[str, Any] = {
        "architectures": [_arch_name(arch)],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": ids[EOS_TOKEN],
        "head_dim": spec["head_dim"],
        "hidden_act": "silu",
        "hidden_size": spec["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": spec["intermediate_size"],
        "max_position_embeddings": spec["max_position_embeddings"],
        "mlp_bias": False,
        "model_type": arch,
        "num_attention_heads": spec["num_attention_heads"],
        "num_hidden_layers": spec["num_hidden_layers"],
        "num_key_value_heads": spec["num_key_value_heads"],
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": spec["rope_theta"],
        "tie_word_embeddings": arch == "llama" and size == "tiny",
        "torch_dtype": spec["torch_dtype"],
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": True,
        "vocab_size": spec["vocab_size"],
    }
    config.update(REAL_MODEL_SETTINGS.get(size, {}))
    if arch == "llama":
        config["pretraining_tp"] = 1
    else:
        config.update(
            max_window_layers=spec["num_hidden_layers"], sliding_window=None, use_sliding_window=False
        )
    return dict(sorted(config.items()))


def build_generation_config(size: str) -> dict[str, Any]:
    ids = special_token_ids(_size_spec(size)["vocab_size"])
    real = REAL_MODEL_SETTINGS.get(size, {})
    return {
        "bos_token_id": real.get("bos_token_id", ids[BOS_TOKEN]),
        "do_sample": False,
        "eos_token_id": real.get("eos_token_id", [ids[EOS_TOKEN], ids[IM_END_TOKEN]]),
        "transformers_version": TRANSFORMERS_VERSION,
    }


def _added_token_dict(content: str) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}


def build_tokenizer_config(size: str, added_tokens: dict[int, str], arch: str = DEFAULT_ARCH) -> dict[str, Any]:
    """tokenizer_config.json; `added_tokens` maps id -> content for every special token."""
    spec = _size_spec(size)
    decoder = {str(i): {**_added_token_dict(content), "special": True} for i, content in added_tokens.items()}
    return {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATES[arch],
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": spec["max_position_embeddings"],
        "pad_token": PAD_TOKEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def build_special_tokens_map() -> dict[str, Any]:
    return {
        "additional_special_tokens": [_added_token_dict(IM_START_TOKEN), _added_token_dict(IM_END_TOKEN)],
        "bos_token": _added_token_dict(BOS_TOKEN),
        "eos_token": _added_token_dict(EOS_TOKEN),
        "pad_token": _added_token_dict(PAD_TOKEN),
    }


# ---------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def train_tokenizer(vocab_size: int) -> str:
    """tokenizer.json text for a byte-level BPE with exactly `vocab_size` tokens (specials included)."""
    num_special = len(SPECIAL_TOKENS)
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - num_special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(generate_corpus(), trainer=trainer)
    shortfall = vocab_size - num_special - tokenizer.get_vocab_size()
    reserved = [f"<|reserved_{index}|>" for index in range(shortfall)]
    added = [AddedToken(token, special=True, normalized=False) for token in (*reserved, *SPECIAL_TOKENS)]
    tokenizer.add_special_tokens(added)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    _check_vocab(tokenizer, vocab_size)
    return tokenizer.to_str(pretty=True)


def _check_vocab(tokenizer: HFTokenizer, vocab_size: int) -> None:
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, expected {vocab_size}")
    for token, expected_id in special_token_ids(vocab_size).items():
        if tokenizer.token_to_id(token) != expected_id:
            raise RuntimeError(
                f"special token {token} has id {tokenizer.token_to_id(token)}, expected {expected_id}"
            )


def added_tokens(tokenizer_json: str) -> dict[int, str]:
    data = json.loads(tokenizer_json)
    return {entry["id"]: entry["content"] for entry in data["added_tokens"]}


# ---------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------


def weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every weight's name and shape, in the order they are generated and stored."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.self_attn.q_proj.weight"] = (q_dim, hidden)
        shapes[f"{prefix}.self_attn.k_proj.weight"] = (kv_dim, hidden)
        shapes[f"{prefix}.self_attn.v_proj.weight"] = (kv_dim, hidden)
        shapes[f"{prefix}.self_attn.o_proj.weight"] = (hidden, q_dim)
        if config["model_type"] == "qwen3":
            shapes[f"{prefix}.self_attn.q_norm.weight"] = (config["head_dim"],)
            shapes[f"{prefix}.self_attn.k_norm.weight"] = (config["head_dim"],)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}.mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}.mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def _init_std(name: str, shape: tuple[int, ...]) -> float:
    if name == "model.embed_tokens.weight":
        return EMBED_STD
    return _gain(name) / shape[1] ** 0.5


def _gain(name: str) -> float:
    if name == "lm_head.weight":
        return LM_HEAD_GAIN
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return QK_GAIN
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return OUT_GAIN
    return LINEAR_GAIN


def _random_weight(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:
        return 1.0 + NORM_NOISE_STD * torch.randn(shape, generator=generator)
    return torch.randn(shape, generator=generator) * _init_std(name, shape)


def plan_shards(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, shard_size: int) -> list[list[str]]:
    """Split the weight names, in order, into shards of at most `shard_size` bytes (a lone big tensor may exceed)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        nbytes = itemsize * _numel(shape)
        if shards[-1] and used + nbytes > shard_size:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def checkpoint_bytes(config: dict[str, Any]) -> int:
    """Size of the weights `make_model` would write for `config`."""
    itemsize = torch.empty((), dtype=DTYPES[config["torch_dtype"]]).element_size()
    return itemsize * sum(_numel(shape) for shape in weight_shapes(config).values())


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _shard_tensors(
    names: list[str], shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    return {name: _random_weight(name, shapes[name], generator).to(dtype).contiguous() for name in names}


def _shard_file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{index:05d}-of-{count:05d}.safetensors" for index in range(1, count + 1)]


def iter_shards(
    config: dict[str, Any], seed: int, shard_size: int
) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    shapes = weight_shapes(config)
    dtype = DTYPES[config["torch_dtype"]]
    shards = plan_shards(shapes, dtype, shard_size)
    generator = torch.Generator().manual_seed(seed)
    for file_name, names in zip(_shard_file_names(len(shards)), shards, strict=True):
        yield file_name, _shard_tensors(names, shapes, dtype, generator)


def write_weights(out_dir: Path, config: dict[str, Any], seed: int, shard_size: int) -> None:
    """Write model.safetensors, or shards plus model.safetensors.index.json."""
    weight_map: dict[str, str] = {}
    total_size = 0
    for file_name, tensors in iter_shards(config, seed, shard_size):
        save_file(tensors, str(out_dir / file_name), metadata={"format": "pt"})
        for name, tensor in tensors.items():
            weight_map[name] = file_name
            total_size += tensor.numel() * tensor.element_size()
    if len(set(weight_map.values())) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(out_dir / "model.safetensors.index.json", index)


# ---------------------------------------------------------------------------------------------
# public entry points
# ---------------------------------------------------------------------------------------------


def _json_text(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(_json_text(data), encoding="utf-8")


def make_model(
    out_dir: str | Path,
    arch: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    with_weights: bool | None = None,
    shard_size: int = DEFAULT_SHARD_SIZE,
) -> Path:
    """Write a random-weight Hugging Face checkpoint for `arch`/`size` into `out_dir` and return it.

    `with_weights` None: weights for every size but the 8b (config and tokenizer only; load it with
    load_format="dummy")."""
    config = build_config(arch, size)
    if with_weights is None:
        with_weights = size not in SIZES_WITHOUT_DEFAULT_WEIGHTS
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_json = train_tokenizer(tokenizer_vocab_size(size))
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", build_generation_config(size))
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    write_json(out / "tokenizer_config.json", build_tokenizer_config(size, added_tokens(tokenizer_json), arch))
    write_json(out / "special_tokens_map.json", build_special_tokens_map())
    if with_weights:
        write_weights(out, config, seed, shard_size)
    return out


def default_cache_dir() -> Path:
    """$LLMSERVE_CACHE_DIR, else $XDG_CACHE_HOME/llmserve, else ~/.cache/llmserve."""
    explicit = os.environ.get("LLMSERVE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "llmserve"


def default_model_dir(arch: str = "llama", size: str = "tiny", seed: int = 0) -> Path:
    """Where `ensure_default_model` keeps the built-in model for these arguments."""
    return default_cache_dir() / "models" / f"{arch}-{size}-seed{seed}"


def ensure_default_model(arch: str = "llama", size: str = "tiny", seed: int = 0) -> Path:
    """Return the cached built-in model directory, creating it atomically on first use."""
    target = default_model_dir(arch, size, seed)
    if target.is_dir():
        refresh_tokenizer_metadata(target, arch, size)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        make_model(staging, arch, size, seed)
        os.rename(staging, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def refresh_tokenizer_metadata(model_dir: Path, arch: str, size: str) -> list[str]:
    """Rewrite a cached checkpoint's tokenizer metadata (the chat template among it) where it differs from
    what `make_model` writes today, so a cache made by an older llmserve is never used with an old
    template. The weights, config and tokenizer.json are pure functions of the arguments and stay as
    they are. Each file is replaced atomically; returns the names of the files rewritten."""
    tokenizer_json = (model_dir / "tokenizer.json").read_text(encoding="utf-8")
    expected = {
        "tokenizer_config.json": build_tokenizer_config(size, added_tokens(tokenizer_json), arch),
        "special_tokens_map.json": build_special_tokens_map(),
    }
    rewritten: list[str] = []
    for name, data in expected.items():
        path = model_dir / name
        text = _json_text(data)
        if path.is_file() and path.read_text(encoding="utf-8") == text:
            continue
        handle, staging = tempfile.mkstemp(prefix=f".{name}.", dir=model_dir)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                file.write(text)
            os.replace(staging, path)
        finally:
            if os.path.exists(staging):
                os.unlink(staging)
        rewritten.append(name)
    return rewritten
