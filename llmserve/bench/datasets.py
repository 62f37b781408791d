"""Synthetic benchmark workloads and the token sources that size their prompts.

A workload is a list of `Conversation`s. Single-turn datasets (random, shared-prefix) are
conversations of one turn; the multi-turn dataset has several, whose prompts grow with the
history (earlier user turns and the server's actual replies) at run time.

Prompt lengths are measured by a `TokenSource`, picked by what is available:
  * `LocalTokenizerSource` (--tokenizer DIR): exact token counts; random prompts are random
    token ids decoded to text (or sent as ids with --prompt-format ids).
  * `ServerTokenizerSource`: the server's /tokenize endpoint counts tokens of word prompts.
  * `WordSource`: no tokenizer at all; one word counts as one token (an approximation).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from llmserve.tokenizer.tokenizer import Tokenizer

Prompt = str | list[int]

# Plain words for prompts when no local tokenizer can turn random token ids into text.
WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is was for on that with as by at from his her they we you it an be this are
    or have had not but what all were when there can said which one do their time if will way about
    many then them write would like so these long make thing see him two has look more day could go
    come did number sound no most people my over know water than call first who may down side been
    now find any new work part take get place made live where after back little only round man year
    came show every good me give our under name very through just form sentence great think say help
    low line differ turn cause much mean before move right boy old too same tell does set three want
    air well also play small end put home read hand port large spell add even land here must big high
    such follow act why ask men change went light kind off need house picture try us again animal
    point mother world near build self earth father head stand own page should country found answer
    school grow study still learn plant cover food sun four between state keep eye never last let
    thought city tree cross farm hard start might story saw far sea draw left late run while press
    close night real life few north open seem together next white children begin got walk example
    """.split()
)


def parse_len_range(text: str) -> tuple[int, int]:
    """Parse "32:512" (inclusive bounds) or "128" (a fixed length)."""
    low_text, sep, high_text = text.partition(":")
    low = int(low_text)
    high = int(high_text) if sep else low
    if low < 1 or high < low:
        raise ValueError(f"bad length range {text!r}: expected LOW:HIGH with 1 <= LOW <= HIGH")
    return low, high


def parse_optional_len_range(text: str) -> tuple[int, int]:
    """As `parse_len_range`, and "0" for none."""
    return (0, 0) if text.strip() == "0" else parse_len_range(text)


# ---------------------------------------------------------------------------------------------
# token sources
# ---------------------------------------------------------------------------------------------


class TokenSource(ABC):
    """Builds prompt text (or token ids) of a given token length and counts tokens of text."""

    name: str = "abstract"
    exact: bool = False

    @abstractmethod
    def count(self, text: str) -> int: ...

    @abstractmethod
    def text(self, num_tokens: int, rng: random.Random) -> tuple[str, int]:
        """Text of about num_tokens tokens, and its measured token count."""

    def ids(self, num_tokens: int, rng: random.Random) -> list[int]:
        raise ValueError(f"--prompt-format ids needs token ids, which the {self.name} token source cannot make; "
                         "pass --tokenizer DIR or use a server with /tokenize")

    def output_counter(self) -> Callable[[str], int] | None:
        """A cheap, local counter for generated text when the server reports no usage (None: count chunks)."""
        return None


class LocalTokenizerSource(TokenSource):
    """Exact lengths from the model's own tokenizer."""

    name = "local"
    exact = True

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        special = tokenizer.all_special_ids
        self._pool = sorted(i for i in tokenizer.get_vocab().values() if i not in special and self._clean(i))
        if not self._pool:
            raise ValueError("the tokenizer has no ordinary tokens to sample prompts from")

    def _clean(self, token_id: int) -> bool:
        """A token that decodes to whole printable characters on its own (not a piece of a UTF-8 sequence)."""
        text = self.tokenizer.decode([token_id])
        return bool(text) and "\ufffd" not in text and (text.isprintable() or text.isspace())

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def ids(self, num_tokens: int, rng: random.Random) -> list[int]:
        return [rng.choice(self._pool) for _ in range(num_tokens)]

    def text(self, num_tokens: int, rng: random.Random) -> tuple[str, int]:
        """Random ids decoded to text, re-encoded and trimmed or topped up until the length is right."""
        ids = self.ids(num_tokens, rng)
        text, measured = "", 0
        for _ in range(10):
            text = self.tokenizer.decode(ids)
            encoded = self.tokenizer.encode(text, add_special_tokens=False)
            measured = len(encoded)
            if measured == num_tokens:
                break
            if measured > num_tokens:
                ids = encoded[:num_tokens]
            else:
                ids = encoded + self.ids(num_tokens - measured, rng)
        return text, measured

    def output_counter(self) -> Callable[[str], int] | None:
        return self.count


class WordFitter(TokenSource, ABC):
    """Builds word prompts and grows or trims them until the counter says the length is right."""

    max_rounds = 8

    def __init__(self) -> None:
        self._tokens_per_word = 1.0

    def calibrate(self, rng: random.Random, sample_words: int = 200) -> None:
        sample = " ".join(rng.choice(WORDS) for _ in range(sample_words))
        self._tokens_per_word = max(self.count(sample) / sample_words, 0.1)

    def text(self, num_tokens: int, rng: random.Random) -> tuple[str, int]:
        words = [rng.choice(WORDS) for _ in range(max(1, round(num_tokens / self._tokens_per_word)))]
        best: tuple[str, int] | None = None
        for _ in range(self.max_rounds):
            text = " ".join(words)
            measured = self.count(text)
            if best is None or abs(measured - num_tokens) < abs(best[1] - num_tokens):
                best = (text, measured)
            if measured == num_tokens:
                break
            per_word = measured / len(words)
            change = max(1, round(abs(measured - num_tokens) / per_word))
            if measured > num_tokens:
                words = words[: max(1, len(words) - change)]
            else:
                words += [rng.choice(WORDS) for _ in range(change)]
        assert best is not None
        return best


class WordSource(WordFitter):
    """No tokenizer available: a word stands for a token."""

    name = "words"

    def count(self, text: str) -> int:
        return len(text.split())

    def output_counter(self) -> Callable[[str], int] | None:
        return None


class ServerTokenizerSource(WordFitter):
    """Counts tokens with the server's /tokenize endpoint (vLLM's request and response shape)."""

    name = "server"
    exact = True

    def __init__(self, client: httpx.Client, url: str, model: str) -> None:
        super().__init__()
        self.client = client
        self.url = url
        self.model = model
        self._id_pool: list[int] = []

    def tokenize(self, text: str) -> list[int]:
        response = self.client.post(self.url, json={"model": self.model, "prompt": text, "add_special_tokens": False})
        response.raise_for_status()
        return [int(t) for t in response.json()["tokens"]]

    def count(self, text: str) -> int:
        return len(self.tokenize(text))

    def ids(self, num_tokens: int, rng: random.Random) -> list[int]:
        """Ids sampled from those the server's tokenizer gives a long stretch of words."""
        if not self._id_pool:
            self._id_pool = sorted(set(self.tokenize(" ".join(rng.choice(WORDS) for _ in range(2000)))))
        return [rng.choice(self._id_pool) for _ in range(num_tokens)]


def probe_server_tokenizer(client: httpx.Client, url: str, model: str) -> ServerTokenizerSource | None:
    """The server's /tokenize as a token source, or None when it has none (or it answers oddly)."""
    source = ServerTokenizerSource(client, url, model)
    try:
        if source.count("hello world") <= 0:
            return None
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        return None
    return source


# ---------------------------------------------------------------------------------------------
# workloads
# ---------------------------------------------------------------------------------------------


@dataclass
class Turn:
    """One user message and how many tokens to ask for in reply."""

    user: Prompt
    input_len: int
    output_len: int


@dataclass
class Conversation:
    turns: list[Turn]
    system: Prompt | None = None
    system_len: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    images: list[str] = field(default_factory=list)  # data: URLs sent before the first user message's text

    @property
    def multi_turn(self) -> bool:
        return len(self.turns) > 1


def _make_prompt(source: TokenSource, num_tokens: int, prompt_format: str, rng: random.Random) -> tuple[Prompt, int]:
    if prompt_format == "ids":
        return source.ids(num_tokens, rng), num_tokens
    return source.text(num_tokens, rng)


def random_dataset(
    source: TokenSource,
    num_prompts: int,
    input_range: tuple[int, int],
    output_range: tuple[int, int],
    prompt_format: str,
    rng: random.Random,
) -> list[Conversation]:
    """Independent prompts with input and output lengths drawn uniformly from the ranges."""
    conversations = []
    for _ in range(num_prompts):
        prompt, length = _make_prompt(source, rng.randint(*input_range), prompt_format, rng)
        conversations.append(Conversation([Turn(prompt, length, rng.randint(*output_range))]))
    return conversations


def shared_prefix_dataset(
    source: TokenSource,
    num_prompts: int,
    prefix_len: int,
    question_len: int,
    output_len: int,
    prompt_format: str,
    rng: random.Random,
) -> list[Conversation]:
    """One long system prompt shared by every request, each followed by its own short question."""
    prefix, measured_prefix = _make_prompt(source, prefix_len, prompt_format, rng)
    conversations = []
    for _ in range(num_prompts):
        question, length = _make_prompt(source, question_len, prompt_format, rng)
        conversations.append(Conversation([Turn(question, length, output_len)], prefix, measured_prefix))
    return conversations


def parse_image_size(text: str) -> tuple[int, int]:
    """Parse "336x224" (width x height)."""
    width, sep, height = text.lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit() or int(width) < 1 or int(height) < 1:
        raise ValueError(f"bad image size {text!r}: expected WIDTHxHEIGHT, e.g. 336x336")
    return int(width), int(height)


def with_random_images(conversations: list[Conversation], count: int, size: tuple[int, int],
                       rng: random.Random) -> list[Conversation]:
    """The conversations with `count` random images each (vLLM's random-mm): PNGs of smooth random colour, each
    request's its own (no prefix cache hits), sent as data: URLs."""
    if count < 1:
        raise ValueError("--images-per-request must be >= 1")
    for conversation in conversations:
        conversation.images = [_random_png(size, rng) for _ in range(count)]
    return conversations


def _random_png(size: tuple[int, int], rng: random.Random) -> str:
    import base64
    import io

    from PIL import Image

    corners = Image.frombytes("RGB", (4, 4), bytes(rng.randrange(256) for _ in range(48)))
    out = io.BytesIO()
    corners.resize(size, Image.Resampling.BICUBIC).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def multi_turn_dataset(
    source: TokenSource,
    num_conversations: int,
    num_turns: int,
    turn_input_len: int,
    turn_output_len: int | tuple[int, int],
    prompt_format: str,
    rng: random.Random,
    system_prompt_len: int = 0,
    first_turn_context_len: tuple[int, int] = (0, 0),
) -> list[Conversation]:
    """Conversations of num_turns user messages; the history is assembled while they run. Reply lengths
    are fixed or drawn per turn from an inclusive (low, high) range (varied lengths keep concurrent
    conversations from moving in lockstep).

    The shape of vLLM's multi-turn benchmark can be added: a system prompt shared by every conversation
    (`system_prompt_len`) and a context of its own in each conversation's first user message, as a chat
    that starts from a document (`first_turn_context_len`, drawn per conversation)."""
    low, high = (turn_output_len, turn_output_len) if isinstance(turn_output_len, int) else turn_output_len
    if prompt_format != "text":
        raise ValueError("the multi-turn dataset sends the server's text replies back, so it needs --prompt-format text")
    if num_turns < 1:
        raise ValueError("--num-turns must be >= 1")
    if system_prompt_len < 0:
        raise ValueError("--system-prompt-len must be >= 0")
    system, measured_system = source.text(system_prompt_len, rng) if system_prompt_len > 0 else (None, 0)
    conversations = []
    for _ in range(num_conversations):
        turns = [Turn(*source.text(turn_input_len, rng), low if low == high else rng.randint(low, high))
                 for _ in range(num_turns)]
        context_len = rng.randint(*first_turn_context_len)
        if context_len > 0:
            context, measured = source.text(context_len, rng)
            first = turns[0]
            turns[0] = Turn(_concat(context, first.user), measured + first.input_len, first.output_len)
        conversations.append(Conversation(turns, system, measured_system, meta={"multi_turn": True}))
    return conversations


# ---------------------------------------------------------------------------------------------
# rendering a turn into a request body
# ---------------------------------------------------------------------------------------------


def _concat(first: Prompt, second: Prompt) -> Prompt:
    if isinstance(first, list) and isinstance(second, list):
        return first + second
    if isinstance(first, str) and isinstance(second, str):
        return f"{first}\n{second}"
    raise ValueError("cannot mix text and token-id prompts")


def completion_prompt(conversation: Conversation, turn: int, replies: Sequence[str]) -> Prompt:
    """The /v1/completions prompt for a turn.

    A single-turn conversation sends its (system + ) user prompt as is, so lengths stay exact. A
    multi-turn one is a plain transcript; each turn's prompt extends the previous one verbatim
    (previous prompt + the server's reply + the new user line), so a prefix cache can hit.
    """
    if not conversation.multi_turn:
        user = conversation.turns[0].user
        return user if conversation.system is None else _concat(conversation.system, user)
    parts: list[str] = [f"{conversation.system}\n"] if conversation.system else []
    for index in range(turn + 1):
        if index > 0:
            parts.append(f"{replies[index - 1]}\n")
        parts.append(f"User: {conversation.turns[index].user}\nAssistant:")
    return "".join(parts)


def chat_messages(conversation: Conversation, turn: int, replies: Sequence[str]) -> list[dict[str, Any]]:
    """The /v1/chat/completions messages for a turn: system, then alternating user / assistant."""
    messages: list[dict[str, Any]] = []
    if conversation.system is not None:
        if not isinstance(conversation.system, str):
            raise ValueError("chat requests need --prompt-format text")
        messages.append({"role": "system", "content": conversation.system})
    for index in range(turn + 1):
        if index > 0:
            messages.append({"role": "assistant", "content": replies[index - 1]})
        user = conversation.turns[index].user
        if not isinstance(user, str):
            raise ValueError("chat requests need --prompt-format text")
        if index == 0 and conversation.images:
            parts = [{"type": "image_url", "image_url": {"url": url}} for url in conversation.images]
            messages.append({"role": "user", "content": [*parts, {"type": "text", "text": user}]})
        else:
            messages.append({"role": "user", "content": user})
    return messages


def estimated_input_len(conversation: Conversation, turn: int, reply_tokens: Sequence[int]) -> int:
    """Prompt tokens of a turn, when the server reports no usage: the pieces, without any template."""
    user = sum(t.input_len for t in conversation.turns[: turn + 1])
    return conversation.system_len + user + sum(reply_tokens[:turn])
