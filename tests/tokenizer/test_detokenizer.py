"""IncrementalDetokenizer: streamed pieces add up to tokenizer.decode and never end in a broken character."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as BackendTokenizer

from llmserve.model.corpus import generate_corpus
from llmserve.tokenizer.detokenizer import IncrementalDetokenizer
from llmserve.tokenizer.tokenizer import Tokenizer

MULTIBYTE = "héllo wörld 日本語 🙂 emoji"
TEXTS = [
    MULTIBYTE,
    "Hello, world! The quick brown fox.",
    "naïve café 👨\u200d👩\u200d👧 한국어 🇯🇵 ελληνικά\n\n  indented\ttab",
    "  two leading spaces and a trailing one ",
    "def f(x):\n    return x + 1  # ok",
    "🙂🙂🙂日本語日本語",
]
SP_SPECIALS = ["<unk>", "<s>", "</s>"]


def _metaspace() -> pre_tokenizers.Metaspace:
    return pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")


def _sp_decoder(style: str) -> decoders.Decoder:
    if style == "llama2":
        steps = [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    else:
        steps = [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
    return decoders.Sequence(steps)


def _trained_merges() -> tuple[list[str], list[tuple[str, str]]]:
    """A small BPE over a limited alphabet, so accented, CJK and emoji text falls back to bytes."""
    trainer_tokenizer = BackendTokenizer(models.BPE())
    trainer_tokenizer.pre_tokenizer = _metaspace()
    trainer = trainers.BpeTrainer(vocab_size=600, limit_alphabet=60, show_progress=False)
    trainer_tokenizer.train_from_iterator(generate_corpus(3000), trainer=trainer)
    model = json.loads(trainer_tokenizer.to_str())["model"]
    tokens = [token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return tokens, merges


def build_byte_fallback_tokenizer(style: str = "llama2") -> Tokenizer:
    """A SentencePiece/Llama-2 style tokenizer: BPE with byte_fallback, Metaspace, `<0xNN>` byte tokens."""
    tokens, merges = _trained_merges()
    vocab: dict[str, int] = {}
    for token in [*SP_SPECIALS, *(f"<0x{byte:02X}>" for byte in range(256)), *tokens]:
        vocab.setdefault(token, len(vocab))
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    backend.pre_tokenizer = _metaspace()
    backend.decoder = _sp_decoder(style)
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SP_SPECIALS])
    backend.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    return Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})


@pytest.fixture(scope="module")
def byte_level(tiny_llama_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module", params=["llama2", "metaspace"])
def byte_fallback(request: pytest.FixtureRequest) -> Tokenizer:
    return build_byte_fallback_tokenizer(request.param)


def stream(
    tokenizer: Tokenizer, ids: Sequence[int], skip: bool, rng: random.Random | None = None
) -> list[str]:
    """Feed `ids` in chunks of 1-3 and check the invariants on every piece."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    pieces: list[str] = []
    position = 0
    while position < len(ids):
        step = rng.choice((1, 1, 1, 2, 3)) if rng else 1
        piece = detok.add(list(ids[position : position + step]))
        position += step
        assert not piece.endswith("\ufffd"), (ids, pieces, piece)
        pieces.append(piece)
        assert detok.output_text == "".join(pieces)
    pieces.append(detok.flush())
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(pieces) == detok.output_text == expected, (ids, pieces)
    assert detok.token_ids == list(ids)
    return pieces


def _random_ids(tokenizer: Tokenizer, rng: random.Random) -> list[int]:
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
    byte_ids = sorted(tokenizer.byte_fallback_ids)
    if byte_ids and rng.random() < 0.6:  # make long runs of byte tokens likely
        ids = [rng.choice(byte_ids) if rng.random() < 0.7 else token for token in ids]
    return ids


# -- byte-level BPE (the built-in models) ----------------------------------------------------


def test_byte_level_pieces_of_multibyte_text(byte_level: Tokenizer) -> None:
    ids = byte_level.encode(MULTIBYTE, add_special_tokens=False)
    assert len(ids) > len(MULTIBYTE.split())  # characters are split across tokens
    pieces = stream(byte_level, ids, skip=True)
    assert "".join(pieces) == MULTIBYTE
    assert all("\ufffd" not in piece for piece in pieces)
    assert "日本" in pieces[pieces.index("") + 1] or "語" in "".join(pieces)


def test_byte_level_holds_back_partial_character(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1  # the emoji's four bytes span several tokens at this vocab size
    detok = IncrementalDetokenizer(byte_level, skip_special_tokens=True)
    assert [detok.add([token]) for token in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add([ids[-1]]) == "🙂"
    assert detok.flush() == ""


def test_flush_emits_incomplete_tail_like_decode(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("ok🙂", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(byte_level, skip_special_tokens=True)
    emitted = "".join(detok.add([token]) for token in ids)
    tail = detok.flush()
    assert emitted + tail == byte_level.decode(ids)
    assert tail.endswith("\ufffd") and "\ufffd" not in emitted


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_texts(byte_level: Tokenizer, text: str, skip: bool) -> None:
    ids = byte_level.encode(text)  # starts with BOS, a special token
    pieces = stream(byte_level, ids, skip, random.Random(0))
    assert "".join(pieces) == (text if skip else "<|begin_of_text|>" + text)


def test_special_tokens_skipped_or_kept(byte_level: Tokenizer) -> None:
    im_end = byte_level.token_to_id("<|im_end|>")
    ids = [*byte_level.encode(" Hello", add_special_tokens=False), im_end]
    ids += byte_level.encode(" world", add_special_tokens=False)
    assert "".join(stream(byte_level, ids, skip=True)) == " Hello world"
    assert "".join(stream(byte_level, ids, skip=False)) == " Hello<|im_end|> world"


@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_random_ids(byte_level: Tokenizer, skip: bool) -> None:
    rng = random.Random(1234)
    for _ in range(400):
        stream(byte_level, _random_ids(byte_level, rng), skip, rng)


# -- SentencePiece-style byte fallback --------------------------------------------------------


def test_byte_fallback_tokenizer_shape(byte_fallback: Tokenizer) -> None:
    assert len(byte_fallback.byte_fallback_ids) == 256
    tokens = byte_fallback.convert_ids_to_tokens(byte_fallback.encode(MULTIBYTE, add_special_tokens=False))
    assert "<0xE6>" in tokens and "<0xF0>" in tokens and any(token.startswith("▁") for token in tokens)
    assert byte_fallback.decode(byte_fallback.encode(MULTIBYTE)) == MULTIBYTE


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_byte_fallback_texts(byte_fallback: Tokenizer, text: str, skip: bool) -> None:
    ids = byte_fallback.encode(text)
    pieces = stream(byte_fallback, ids, skip, random.Random(0))
    assert all("\ufffd" not in piece for piece in pieces)


def test_byte_fallback_waits_for_the_end_of_a_byte_run(byte_fallback: Tokenizer) -> None:
    """A later byte token can turn a valid run into U+FFFDs, so a run is held until a non-byte token."""
    e_acute = [byte_fallback.token_to_id("<0xC3>"), byte_fallback.token_to_id("<0xA9>")]
    stray = byte_fallback.token_to_id("<0xA9>")
    word = byte_fallback.encode("ok", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_fallback, skip_special_tokens=True)
    assert detok.add(word) == "ok"
    assert detok.add(e_acute) == ""  # "é" is complete, but the run may go on
    assert detok.add([stray]) == ""
    assert detok.flush() == "\ufffd\ufffd\ufffd"
    assert byte_fallback.decode([*word, *e_acute, stray]) == "ok\ufffd\ufffd\ufffd"
    detok = IncrementalDetokenizer(byte_fallback, skip_special_tokens=True)
    assert detok.add([*word, *e_acute]) == ""
    assert detok.add(word) == "oké ok"
    assert detok.output_text == byte_fallback.decode([*word, *e_acute, *word])


@pytest.mark.parametrize("skip", [True, False])
def test_byte_fallback_random_ids(byte_fallback: Tokenizer, skip: bool) -> None:
    rng = random.Random(99)
    for _ in range(400):
        stream(byte_fallback, _random_ids(byte_fallback, rng), skip, rng)


def test_leading_space_is_stripped_like_decode(byte_fallback: Tokenizer) -> None:
    ids = byte_fallback.encode("hello world", add_special_tokens=False)
    assert byte_fallback.convert_ids_to_tokens(ids)[0].startswith("▁")
    pieces = stream(byte_fallback, ids, skip=True)
    assert "".join(pieces) == "hello world"
    bos_first = [1, *ids]
    assert "".join(stream(byte_fallback, bos_first, skip=True)) == "hello world"
    assert "".join(stream(byte_fallback, bos_first, skip=False)) == byte_fallback.decode(bos_first, False)


# -- cost ---------------------------------------------------------------------------------------


def _longest_byte_run(ids: Sequence[int], byte_ids: frozenset[int]) -> int:
    longest = current = 0
    for token in ids:
        current = current + 1 if token in byte_ids else 0
        longest = max(longest, current)
    return longest


class _CountingTokenizer(Tokenizer):
    """Records the length of every decode call."""

    def __init__(self, inner: Tokenizer) -> None:
        self.__dict__.update(inner.__dict__)
        self.window_lengths: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.window_lengths.append(len(ids))
        return super().decode(ids, skip_special_tokens)


@pytest.mark.parametrize("kind", ["byte_level", "byte_fallback"])
def test_decodes_only_a_short_window(kind: str, byte_level: Tokenizer) -> None:
    tokenizer = byte_level if kind == "byte_level" else build_byte_fallback_tokenizer()
    counting = _CountingTokenizer(tokenizer)
    ids = tokenizer.encode(" ".join(TEXTS[:5]) * 8, add_special_tokens=False)
    assert len(ids) > 300
    detok = IncrementalDetokenizer(counting, skip_special_tokens=True)
    text = "".join(detok.add([token]) for token in ids) + detok.flush()
    assert text == tokenizer.decode(ids)
    # the window is one token of context plus what is held back (a byte-fallback run is held whole):
    # it does not grow with the length of the output
    assert max(counting.window_lengths) <= 8 + _longest_byte_run(ids, tokenizer.byte_fallback_ids)
    assert sum(counting.window_lengths) <= 4 * len(ids)
    assert len(counting.window_lengths) <= 2 * len(ids) + 1


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("kind", ["byte_level", "llama2", "metaspace"])
def test_each_tokens_bytes_join_into_the_text(kind: str, text: str, byte_level: Tokenizer) -> None:
    """OpenAI's logprobs `bytes`: a piece of a character is its own bytes (its text alone is U+FFFD)."""
    tokenizer = byte_level if kind == "byte_level" else build_byte_fallback_tokenizer(kind)
    ids = tokenizer.encode(text, add_special_tokens=False)
    joined = b"".join(tokenizer.token_bytes(token) for token in ids)
    # SentencePiece writes the space before the first word as well (its "▁"), which decoding drops
    assert joined in (text.encode(), b" " + text.encode())
    split = [token for token in ids if "\ufffd" in tokenizer.decode([token])]
    if any(ord(char) > 0x7FF for char in text):  # a 3- or 4-byte character: some token holds a piece of it
        assert split and all(tokenizer.token_bytes(token) != "\ufffd".encode() for token in split)
