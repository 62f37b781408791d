"""A deterministic text corpus, generated in code, for training the built-in models' tokenizer.

Nothing here is downloaded: the text is assembled from the word lists below with a seeded
`random.Random`, so the same seed always yields the same lines. The mix (English prose, code,
numbers, punctuation, accented words, CJK text and emoji) gives a byte-level BPE vocabulary that
covers the kinds of text tests and benchmarks send, and the invented words give BPE enough
distinct material to fill a 32k vocabulary.
"""

from __future__ import annotations

import random
from collections.abc import Callable

ENGLISH_WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is was that for it with as on be at by this had not are but from or have an
    they which one you were her all she there would their we him been has when who will more no if
    out so said what up its about into than them can only other new some could time these two may
    then do first any my now such like our over man me even most made after also did many before
    must through back years where much your way well down should because each just those people
    how too little state good very make world still own see men work long get here between both
    life being under never day same another know while last might us great old year off come since
    against go came right used take three place small found part every general high upon school
    water house point city number system world model token server request response stream cache
    memory engine batch queue prompt answer question reason simple quick brown fox jumps lazy dog
    river mountain forest ocean garden window table chair paper letter music story light dark
    morning evening night summer winter spring autumn friend family child mother father brother
    sister teacher student doctor market street road bridge train plane ship car bicycle window
    green blue red yellow white black purple orange silver golden happy quiet loud fast slow warm
    cold early late open close begin end start stop write read speak listen think believe learn
    teach build break carry change choose follow forget give help hold keep leave live lose love
    meet move need offer pay play pull push run say seem send show sit stand stay talk tell try
    turn understand use wait walk want watch wear win wonder yes hello goodbye please thanks sorry
    computer program language science history nature energy power value price market report
    because although however therefore meanwhile perhaps certainly probably usually always often
    sometimes rarely already again almost enough together quickly slowly carefully happily
    """.split()
)

CODE_WORDS: tuple[str, ...] = tuple(
    """
    def return class import from self None True False if else elif for while in not and or try
    except finally with as yield lambda async await pass break continue raise assert print len
    range list dict set tuple str int float bool open read write append extend items keys values
    function const let var new this null undefined console log public private static void main
    string vector struct impl fn mut match enum trait use mod pub crate include define ifdef
    config params tensor shape dtype device layer weight bias hidden output input batch index
    """.split()
)

ACCENTED_WORDS: tuple[str, ...] = tuple(
    """
    café naïve résumé façade déjà vu crème brûlée über schön grüße straße mädchen fünf zwölf
    señor mañana niño año corazón canción jalapeño piñata où être très garçon hôtel élève noël
    ça français português não coração ação lição português københavn smørrebrød ærø åland
    zürich münchen köln düsseldorf kraków łódź gdańsk žluťoučký kůň příliš čeština ελληνικά
    καλημέρα αγάπη θάλασσα привет мир спасибо здравствуйте книга язык москва
    """.split()
)

CJK_TEXT: tuple[str, ...] = (
    "日本語",
    "東京",
    "大阪",
    "こんにちは",
    "ありがとう",
    "さようなら",
    "おはようございます",
    "今日は天気がいいです",
    "私は学生です",
    "猫が好きです",
    "中文",
    "你好",
    "谢谢",
    "北京",
    "上海",
    "我们去吃饭吧",
    "今天天气很好",
    "人工智能",
    "机器学习",
    "한국어",
    "안녕하세요",
    "감사합니다",
    "서울",
    "사랑해요",
)

EMOJI: tuple[str, ...] = (
    "🙂",
    "😀",
    "😂",
    "😍",
    "🤔",
    "👍",
    "🎉",
    "🚀",
    "🔥",
    "💡",
    "🌍",
    "🍕",
    "☕",
    "❤️",
    "✨",
    "🐍",
    "🤖",
    "👋🏽",
    "👨‍👩‍👧",
    "🇯🇵",
)

PUNCTUATION: tuple[str, ...] = (".", ".", ".", ",", "!", "?", ";", ":", "...", " -", "")

_ONSETS: tuple[str, ...] = tuple(
    "b c d f g h j k l m n p r s t v w z br cr dr fl gr pl st tr ch sh th".split()
)
_VOWELS: tuple[str, ...] = tuple("a e i o u a e i o ai ou ea".split())
_CODAS: tuple[str, ...] = ("", "", "", "n", "r", "s", "l", "m", "t", "nd", "st", "ng")


def _zipf_choice(rng: random.Random, words: tuple[str, ...]) -> str:
    """Pick a word with a Zipf-like bias towards the start of the list."""
    index = int(len(words) * rng.random() ** 2.5)
    return words[min(index, len(words) - 1)]


def invented_word(rng: random.Random) -> str:
    """A pronounceable made-up word of one to four syllables."""
    syllables = rng.choice((1, 2, 2, 3, 3, 4))
    parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables)]
    return "".join(parts)


def _english_word(rng: random.Random) -> str:
    if rng.random() < 0.25:
        return invented_word(rng)
    return _zipf_choice(rng, ENGLISH_WORDS)


def english_sentence(rng: random.Random) -> str:
    words = [_english_word(rng) for _ in range(rng.randint(4, 18))]
    words[0] = words[0].capitalize()
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), f'"{_english_word(rng)}"')
    if rng.random() < 0.15:
        words.insert(rng.randrange(len(words)), f"({_english_word(rng)})")
    return " ".join(words) + rng.choice(PUNCTUATION)


def _identifier(rng: random.Random) -> str:
    parts = [rng.choice(CODE_WORDS + ENGLISH_WORDS[:120]) for _ in range(rng.randint(1, 3))]
    style = rng.random()
    if style < 0.5:
        return "_".join(parts)
    if style < 0.8:
        return parts[0] + "".join(p.capitalize() for p in parts[1:])
    return "".join(p.capitalize() for p in parts)


def code_line(rng: random.Random) -> str:
    name, arg, other = _identifier(rng), _identifier(rng), _identifier(rng)
    number = rng.randint(0, 4096)
    templates = (
        f"def {name}({arg}, {other}={number}):",
        f"    return {arg} + {other} * {number}",
        f"    {name} = {arg}[{number}:{number + 8}]",
        f"if {arg} is not None and len({other}) > {number}:",
        f"for {arg} in range({number}):",
        f"    {name}.append({{'{arg}': {number}, '{other}': None}})",
        f"const {name} = ({arg}) => {arg}.{other}({number});",
        f"let {name}: Vec<u32> = vec![{number}; {rng.randint(1, 64)}];",
        f"{name}({arg}, {other}); // {rng.choice(ENGLISH_WORDS)} {rng.choice(ENGLISH_WORDS)}",
        f"# {rng.choice(ENGLISH_WORDS)} the {arg} before {other}",
        f"import {name}.{arg} as {other}",
        f'print(f"{{{arg}}} = {{{other}:.{rng.randint(1, 6)}f}}")',
    )
    return rng.choice(templates)


def number_text(rng: random.Random) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        return f"{rng.randint(0, 10 ** rng.randint(1, 9))}"
    if kind == 1:
        return f"{rng.uniform(-1000, 1000):.{rng.randint(1, 4)}f}"
    if kind == 2:
        return f"{rng.randint(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if kind == 3:
        return f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    if kind == 4:
        return f"{rng.randint(1, 99)}% of {rng.randint(100, 9999)}"
    return f"${rng.randint(1, 999)}.{rng.randint(0, 99):02d}"


def numbers_line(rng: random.Random) -> str:
    items = [number_text(rng) for _ in range(rng.randint(1, 6))]
    words = [rng.choice(ENGLISH_WORDS) for _ in items]
    return " ".join(f"{w} {n}" for w, n in zip(words, items, strict=True)) + rng.choice(PUNCTUATION)


def multilingual_line(rng: random.Random) -> str:
    pieces: list[str] = []
    for _ in range(rng.randint(3, 10)):
        kind = rng.random()
        if kind < 0.35:
            pieces.append(rng.choice(ACCENTED_WORDS))
        elif kind < 0.6:
            pieces.append(rng.choice(CJK_TEXT))
        elif kind < 0.75:
            pieces.append(rng.choice(EMOJI))
        else:
            pieces.append(_english_word(rng))
    return " ".join(pieces) + rng.choice(("", "。", "!", ".", " 🙂"))


def chat_line(rng: random.Random) -> str:
    role = rng.choice(("user", "assistant", "system"))
    return f"{role}: {english_sentence(rng)}"


_GENERATORS: tuple[tuple[Callable[[random.Random], str], float], ...] = (
    (english_sentence, 0.5),
    (code_line, 0.2),
    (numbers_line, 0.1),
    (multilingual_line, 0.12),
    (chat_line, 0.08),
)


def corpus_line(rng: random.Random) -> str:
    """One line of corpus text, drawn from a weighted mix of generators."""
    pick = rng.random()
    for generate, weight in _GENERATORS:
        if pick < weight:
            return generate(rng)
        pick -= weight
    return english_sentence(rng)


def generate_corpus(num_lines: int = 40_000, seed: int = 0) -> list[str]:
    """`num_lines` lines of text; the same arguments always give the same list."""
    rng = random.Random(seed)
    return [corpus_line(rng) for _ in range(num_lines)]
