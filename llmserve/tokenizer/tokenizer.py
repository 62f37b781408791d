"""A thin wrapper over `tokenizers.Tokenizer` that reads the Hugging Face checkpoint layout.

It loads `tokenizer.json` plus `tokenizer_config.json` (special tokens, BOS/EOS flags, chat
template) and behaves like `transformers.AutoTokenizer` does for encode, decode and
apply_chat_template, without importing transformers.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, NoReturn, overload

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from llmserve.errors import InvalidRequestError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
PROCESSOR_TEMPLATE_FILE = "chat_template.json"  # where a multimodal model's processor keeps its template
NAMED_SPECIAL_TOKENS: tuple[str, ...] = ("bos_token", "eos_token", "unk_token", "pad_token")
EXTRA_SPECIAL_TOKEN_KEYS: tuple[str, ...] = ("additional_special_tokens", "extra_special_tokens")
# transformers writes a huge sentinel (int(1e30)) when a tokenizer has no length limit.
_UNLIMITED_LENGTH = 10**18


def _token_content(value: Any) -> str | None:
    """A special-token field is a string, or a dict with "content" as transformers writes AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _select_chat_template(value: Any) -> str | None:
    """chat_template is a string, or a list of {name, template} dicts where "default" wins."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        templates = {
            entry.get("name"): entry.get("template") for entry in value if isinstance(entry, Mapping)
        }
        default = templates.get("default")
        return default if isinstance(default, str) else None
    return None


def _added_token(content: str, spec: Mapping[str, Any]) -> AddedToken:
    return AddedToken(
        content,
        single_word=bool(spec.get("single_word", False)),
        lstrip=bool(spec.get("lstrip", False)),
        rstrip=bool(spec.get("rstrip", False)),
        normalized=bool(spec.get("normalized", not spec.get("special", False))),
        special=bool(spec.get("special", False)),
    )


REPLACEMENT_CHAR = "\ufffd"


def _byte_level_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a byte-level BPE vocabulary
    (printable bytes as themselves, the others as the characters from U+0100 on, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    written = {byte: chr(byte) for byte in printable}
    others = (byte for byte in range(256) if byte not in written)
    written |= {byte: chr(256 + i) for i, byte in enumerate(others)}
    return {char: byte for byte, char in written.items()}


BYTE_LEVEL_BYTES = _byte_level_bytes()
SENTENCEPIECE_SPACE = "\u2581"


def _decoder_types(node: Any) -> set[str]:
    """Every decoder "type" named in a (possibly nested) decoder config."""
    found: set[str] = set()
    if isinstance(node, Mapping):
        if isinstance(node.get("type"), str):
            found.add(node["type"])
        for child in node.values():
            found |= _decoder_types(child)
    elif isinstance(node, list):
        for child in node:
            found |= _decoder_types(child)
    return found


# ---------------------------------------------------------------------------------------------
# chat template rendering
# ---------------------------------------------------------------------------------------------


def _longest_first(first: int, second: int, room: int) -> tuple[int, int]:
    """How many tokens of each text of a pair fit in `room` when the longer one is cut first (the tokenizers
    library's LongestFirst: a tie gives the second text the odd token)."""
    if first + second <= room:
        return first, second
    if first > second:
        kept = min(second, room // 2)
        return room - kept, kept
    kept = min(first, room // 2)
    return kept, room - kept


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def _template_environment() -> ImmutableSandboxedEnvironment:
    """The sandboxed environment transformers renders chat templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    return _template_environment().from_string(template)


def read_chat_template(given: str) -> str:
    """A chat template given by the operator (vLLM's --chat-template): the file `given` names, else `given`
    itself when it reads as a template; it must compile. Raises ValueError saying what is wrong."""
    path = Path(given).expanduser()
    if any(mark in given for mark in ("{{", "{%", "\n")):
        template = given  # (checked first: a template longer than a file name is no path to look up)
    elif path.is_file():
        template = path.read_text(encoding="utf-8")
    else:
        raise ValueError(f"chat_template: {given!r} is neither a file nor a Jinja template.")
    try:
        compile_chat_template(template)
    except jinja2.TemplateError as exc:
        raise ValueError(f"chat_template does not compile: {exc}") from None
    return template


@functools.lru_cache(maxsize=16)
def chat_template_variables(template: str) -> frozenset[str]:
    """The variables a chat template reads from its context (`messages`, `enable_thinking`, ...)."""
    return frozenset(jinja2.meta.find_undeclared_variables(_template_environment().parse(template)))


def _has_image_parts(content: list[Any]) -> bool:
    """Content parts with `{"type": "image"}` places: a vision-language model's template writes them itself."""
    return any(isinstance(part, Mapping) and part.get("type") == "image" for part in content)


def _content_text(content: list[Any]) -> str:
    """Join the text parts of an OpenAI-style content list."""
    texts: list[str] = []
    for part in content:
        if (
            not isinstance(part, Mapping)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
        ):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise InvalidRequestError(
                f"unsupported message content part {kind!r}: only text parts are supported", param="messages"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _template_tool_call(call: Any, where: str) -> Any:
    """A copy of an OpenAI tool call whose `function.arguments` JSON text is parsed: templates expect a dict."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(
                f"{where}.function.arguments is not valid JSON: {exc.msg}", param=f"{where}.function.arguments"
            ) from exc
    return {**call, "function": function}


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Drop None-valued keys (as transformers does), flatten list content into a string (unless it places
    images: the template takes those parts), and parse the JSON arguments of assistant tool calls (as vLLM does)."""
    normalized: list[dict[str, Any]] = []
    for position, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError("each message must be an object", param="messages")
        entry = {key: value for key, value in message.items() if value is not None}
        if isinstance(entry.get("content"), list) and not _has_image_parts(entry["content"]):
            entry["content"] = _content_text(entry["content"])
        if isinstance(entry.get("tool_calls"), list):
            entry["tool_calls"] = [
                _template_tool_call(call, f"messages[{position}].tool_calls[{index}]")
                for index, call in enumerate(entry["tool_calls"])
            ]
        normalized.append(entry)
    return normalized


def _open_final_message(text: str, final: Mapping[str, Any]) -> str:
    """The rendered chat cut just after the final message's text (its last occurrence; as stripped of
    surrounding whitespace when the template strips it): what the template adds after a message, an
    end-of-turn token, is gone."""
    content = final.get("content")
    if not isinstance(content, str) or not content.strip():
        raise InvalidRequestError(
            "continue_final_message needs a final message with text to continue", param="messages"
        )
    for piece in (content, content.strip()):
        end = text.rfind(piece)
        if end >= 0:
            return text[: end + len(piece)]
    raise InvalidRequestError(
        "continue_final_message: the chat template does not render the final message's text as given, so "
        "it cannot be continued", param="messages",
    )


def render_chat_template(template: str, context: dict[str, Any]) -> str:
    """Render `template` with `context`; any template failure becomes an InvalidRequestError."""
    try:
        return compile_chat_template(template).render(**context)
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(f"chat template error: {exc}", param="messages") from exc
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise InvalidRequestError(
            f"chat template could not render these messages: {exc!r}", param="messages"
        ) from exc


# ---------------------------------------------------------------------------------------------
# the tokenizer
# ---------------------------------------------------------------------------------------------


class Tokenizer:
    """Encode/decode text and render chat templates for one model."""

    def __init__(
        self,
        backend: BackendTokenizer,
        config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self._single_token_text: dict[tuple[int, bool], str] = {}
        self._config: dict[str, Any] = dict(config or {})
        backend.no_truncation()
        backend.no_padding()
        self._special_tokens: dict[str, str] = self._read_named_tokens()
        self._extra_special_tokens: list[str] = self._read_extra_tokens()
        self._register_added_tokens()
        self._prepend_bos_id = self._bos_to_prepend()
        if chat_template is None:
            chat_template = _select_chat_template(self._config.get("chat_template"))
        self._chat_template = chat_template
        self._skip_special_ids = frozenset(
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        )
        self._byte_fallback_ids = self._find_byte_fallback_ids()
        decoder = backend.decoder
        decoders = _decoder_types(json.loads(decoder.__getstate__())) if decoder is not None else set()
        self._byte_level = "ByteLevel" in decoders  # GPT-2's byte alphabet
        self._word_marks = bool({"Metaspace", "Replace"} & decoders)  # SentencePiece's "▁" for a space

    # -- loading ------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, chat_template: str | None = None) -> Tokenizer:
        """Load from a directory holding tokenizer.json and, optionally, tokenizer_config.json.
        `chat_template` (a template's text) replaces the directory's own."""
        directory = Path(path)
        tokenizer_file = directory / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in {directory}")
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        config_file = directory / TOKENIZER_CONFIG_FILE
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        template_file, processor_file = directory / CHAT_TEMPLATE_FILE, directory / PROCESSOR_TEMPLATE_FILE
        if chat_template is None and template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        elif chat_template is None and processor_file.is_file() and not config.get("chat_template"):
            chat_template = json.loads(processor_file.read_text(encoding="utf-8")).get("chat_template")
        return cls(backend, config, chat_template)

    def _read_named_tokens(self) -> dict[str, str]:
        named: dict[str, str] = {}
        for name in NAMED_SPECIAL_TOKENS:
            content = _token_content(self._config.get(name))
            if content is not None:
                named[name] = content
        return named

    def _read_extra_tokens(self) -> list[str]:
        extra: list[str] = []
        for key in EXTRA_SPECIAL_TOKEN_KEYS:
            values = self._config.get(key)
            if isinstance(values, Mapping):
                values = list(values.values())
            for value in values if isinstance(values, list) else []:
                content = _token_content(value)
                if content is not None and content not in extra:
                    extra.append(content)
        return extra

    def _register_added_tokens(self) -> None:
        """Add config tokens the backend lacks, as transformers does on load."""
        decoder = self._config.get("added_tokens_decoder") or {}
        missing: list[AddedToken] = []
        for _, spec in sorted(decoder.items(), key=lambda item: int(item[0])):
            content = _token_content(spec)
            if content is not None and self._backend.token_to_id(content) is None:
                missing.append(_added_token(content, spec))
        for content in (*self._special_tokens.values(), *self._extra_special_tokens):
            if self._backend.token_to_id(content) is None and all(t.content != content for t in missing):
                missing.append(AddedToken(content, special=True, normalized=False))
        if missing:
            self._backend.add_tokens(missing)

    def _bos_to_prepend(self) -> int | None:
        """The BOS id when the config says add_bos_token but the tokenizer.json post-processor does not add it.

        The post-processor is otherwise respected as is: like transformers 5 when tokenizer.json
        exists, add_bos_token=false does not remove a BOS it adds, and add_eos_token is ignored.
        """
        bos_id = self.bos_token_id
        if not self._config.get("add_bos_token") or bos_id is None:
            return None
        ids = self._backend.encode("a", add_special_tokens=True).ids
        return bos_id if not ids or ids[0] != bos_id else None

    def _find_byte_fallback_ids(self) -> frozenset[int]:
        """Ids of `<0xNN>` tokens when the decoder turns them back into bytes (SentencePiece style)."""
        decoder = self._backend.decoder
        if decoder is None or "ByteFallback" not in _decoder_types(json.loads(decoder.__getstate__())):
            return frozenset()
        ids: set[int] = set()
        for byte in range(256):
            for spelling in (f"<0x{byte:02X}>", f"<0x{byte:02x}>"):
                token_id = self._backend.token_to_id(spelling)
                if token_id is not None:
                    ids.add(token_id)
        return frozenset(ids)

    # -- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch_fast releases the GIL (encode does not), so a long text tokenized on a worker
        # thread leaves the event loop running; and it skips offsets, which are slow to free, with the GIL.
        ids = self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._prepend_bos_id is not None:
            return [self._prepend_bos_id, *ids]
        return ids

    def encode_pieces(self, texts: Sequence[str]) -> list[list[int]]:
        """Several short texts' ids without special tokens, in one call (no BOS either)."""
        return [encoding.ids for encoding in self._backend.encode_batch_fast(list(texts), add_special_tokens=False)]

    def encode_truncated(self, text: str, max_length: int) -> list[int]:
        """The text's tokens with the special tokens, the text cut from the right so that all of it fits
        in `max_length` (transformers' `truncation=True`, as sentence-transformers embeds)."""
        encoding = self._backend.encode_batch_fast([text], add_special_tokens=False)[0]
        room = max_length - self._backend.num_special_tokens_to_add(False) - (self._prepend_bos_id is not None)
        if len(encoding.ids) > room:
            encoding.truncate(max(room, 0))
        ids = self._backend.post_process(encoding).ids
        return [self._prepend_bos_id, *ids] if self._prepend_bos_id is not None else ids

    @property
    def pair_special_tokens(self) -> int:
        """How many special tokens the post-processor adds to a text pair."""
        return self._backend.num_special_tokens_to_add(True)

    def encode_pair(self, first: str, second: str, max_length: int | None = None) -> tuple[list[int], int | None]:
        """A text pair's tokens as the tokenizer's post-processor joins them (BERT: `[CLS] a [SEP] b [SEP]`,
        RoBERTa: `<s> a </s></s> b </s>`), and where token type 1 starts (None: one type throughout). Cut to
        `max_length` as transformers' `truncation="longest_first"` cuts: the longer text loses its last tokens."""
        a, b = self._backend.encode_batch_fast([first, second], add_special_tokens=False)
        if max_length is not None:
            room = max(max_length - self.pair_special_tokens, 0)
            keep_a, keep_b = _longest_first(len(a.ids), len(b.ids), room)
            a.truncate(keep_a)
            b.truncate(keep_b)
        encoding = self._backend.post_process(a, b)
        types = encoding.type_ids
        return encoding.ids, types.index(1) if 1 in types else None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids if isinstance(ids, list) else list(ids), skip_special_tokens=skip_special_tokens)

    def decode_one(self, token_id: int, skip_special_tokens: bool = True) -> str:
        """`decode([token_id])`, memoised: incremental detokenization asks for it once per generated token."""
        key = (token_id, skip_special_tokens)
        text = self._single_token_text.get(key)
        if text is None:
            text = self._single_token_text[key] = self.decode([token_id], skip_special_tokens)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token stands for (OpenAI's logprobs `bytes`, which join into the text): a piece
        of a UTF-8 character is its own bytes, not U+FFFD's, and a SentencePiece word keeps the space
        that decoding it alone strips."""
        piece = self._backend.id_to_token(token_id)
        if piece is not None and token_id not in self._skip_special_ids:
            if token_id in self._byte_fallback_ids:  # "<0xE4>"
                return bytes([int(piece[3:5], 16)])
            if self._byte_level and all(char in BYTE_LEVEL_BYTES for char in piece):
                return bytes(BYTE_LEVEL_BYTES[char] for char in piece)
            if self._word_marks and SENTENCEPIECE_SPACE in piece:
                return piece.replace(SENTENCEPIECE_SPACE, " ").encode()
        return self.decode_one(token_id, skip_special_tokens=False).encode()

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        tokens: list[str] = []
        for token_id in ids:
            token = self._backend.id_to_token(token_id)
            if token is None:
                raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
            tokens.append(token)
        return tokens

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        decoder = self._backend.decoder
        return decoder.decode(list(tokens)) if decoder is not None else " ".join(tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    # -- properties ---------------------------------------------------------------------------

    @property
    def backend(self) -> BackendTokenizer:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def _named_id(self, name: str) -> int | None:
        content = self._special_tokens.get(name)
        return None if content is None else self._backend.token_to_id(content)

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self._special_tokens.get("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self._special_tokens.get("unk_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._named_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._named_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._named_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._named_id("unk_token")

    @property
    def all_special_ids(self) -> set[int]:
        """Ids of the named and extra special tokens and of every added token marked special."""
        contents = (*self._special_tokens.values(), *self._extra_special_tokens)
        ids = {self._backend.token_to_id(content) for content in contents}
        return {token_id for token_id in ids if token_id is not None} | set(self._skip_special_ids)

    @property
    def skip_special_ids(self) -> frozenset[int]:
        """Exactly the ids that `decode(..., skip_special_tokens=True)` leaves out."""
        return self._skip_special_ids

    @property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of `<0xNN>` byte tokens the decoder merges into characters (empty if it has no ByteFallback)."""
        return self._byte_fallback_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    def template_places_images(self) -> bool:
        """Whether the chat template writes image content parts itself (a vision-language model's, as llava-hf's
        do); else a message's images are put before its text."""
        template = self._chat_template
        return template is not None and ("'image'" in template or '"image"' in template)

    def template_reads(self, variable: str, template: str | None = None) -> bool:
        """Whether the chat template (`template`, else the model's) reads `variable` (so that a request setting it
        changes the prompt)."""
        template = template if template is not None else self._chat_template
        return template is not None and variable in chat_template_variables(template)

    @property
    def model_max_length(self) -> int | None:
        value = self._config.get("model_max_length")
        if isinstance(value, (int, float)) and 0 < value < _UNLIMITED_LENGTH:
            return int(value)
        return None

    # -- chat ---------------------------------------------------------------------------------

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = ...,
        tokenize: Literal[False] = ...,
        tools: Sequence[Mapping[str, Any]] | None = ...,
        **extra: Any,
    ) -> str: ...

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = ...,
        *,
        tokenize: Literal[True],
        tools: Sequence[Mapping[str, Any]] | None = ...,
        **extra: Any,
    ) -> list[int]: ...

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = ...,
        tokenize: bool = ...,
        tools: Sequence[Mapping[str, Any]] | None = ...,
        **extra: Any,
    ) -> str | list[int]: ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **extra: Any,
    ) -> str | list[int]:
        """Render the chat template (`chat_template`'s text for this call, if given); with `tokenize`, return the
        token ids (no special tokens re-added).

        `tools` are OpenAI tool dicts ({"type": "function", "function": {...}}), given to the template as
        `tools`; `extra` are further template variables (a request's `chat_template_kwargs`, such as
        Qwen3's `enable_thinking`). Messages may hold assistant `tool_calls` and `role: "tool"` results.
        `continue_final_message` (vLLM's) ends the text right after the final message's own text, so the
        model goes on with that message (an assistant reply begun by the caller) instead of a new one.
        """
        template = chat_template if chat_template is not None else self._chat_template
        if template is None:
            raise InvalidRequestError(
                "this model's tokenizer has no chat template, so chat requests are not supported; "
                "use the completions API with a plain prompt instead",
                param="messages",
            )
        context: dict[str, Any] = {"tools": None, "documents": None, **self._special_tokens, **extra}
        if tools is not None:
            context["tools"] = [dict(tool) for tool in tools]
        context["messages"] = normalize_messages(messages)
        context["add_generation_prompt"] = add_generation_prompt
        text = render_chat_template(template, context)
        if continue_final_message:
            text = _open_final_message(text, context["messages"][-1] if context["messages"] else {})
        return self.encode(text, add_special_tokens=False) if tokenize else text
