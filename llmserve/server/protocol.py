"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests use `extra="forbid"`: a field nobody has heard of is a 400 naming it, never silently ignored.
Fields that only carry metadata (`user`, `service_tier`) are declared and accepted without effect; a chat
completion's `store` and `metadata` keep it where the platform stores completions (server/stored_completions.py). Fields the OpenAI API has but this server does not implement are declared, so that
`unsupported_params()` can name them in a 400. Booleans and integers are strictly typed (`"yes"` is
not true, `true` is not 1); floats accept integers. Fields whose type is
a union (`stop`, `prompt`, message `content`) are checked by validators that raise on the field
itself, so an error's location is the field the client sent, not a union branch.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from llmserve.platform import metadata as metadata_bounds

MAX_LOGPROBS = 20
# Integers the engine receives must fit 64 bits (its messages are MessagePack), as vLLM bounds its own.
Int64 = Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)]
# OpenAI's metadata (platform/metadata.py): at most 16 pairs, keys up to 64 characters, values up to 512.
Metadata = Annotated[
    dict[Annotated[StrictStr, Field(max_length=metadata_bounds.MAX_KEY_LENGTH)],
         Annotated[StrictStr, Field(max_length=metadata_bounds.MAX_VALUE_LENGTH)]],
    Field(max_length=metadata_bounds.MAX_PAIRS),
]
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_BAD_WORDS = 128
MAX_MESSAGES = 2048
MAX_N = 128
MAX_DOCUMENTS = 1024  # a RAG chat template's documents in one request
MAX_PROMPTS = 2048  # in one completions request, as OpenAI
# Chat template variables that come from the request's own fields, never from chat_template_kwargs
# (`tokenize` and `self` are the rendering call's own arguments).
RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "add_generation_prompt", "tools", "documents", "tokenize", "self"}
)


def _check_template_variables(value: dict[str, Any] | None) -> dict[str, Any] | None:
    reserved = sorted(set(value or ()) & RESERVED_TEMPLATE_VARIABLES)
    if reserved:
        raise ValueError(f"{', '.join(reserved)} cannot be set here: the request's own fields set them")
    return value


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Request(BaseModel):
    # Unknown fields are a 400 (no silent ignores); NaN and infinity are refused.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# JSON nested deeper than this in a request body is a 400: schemas and structural tags are copied, dumped
# and compiled by recursive code, which a body a few hundred levels deep would exhaust (a 500).
MAX_JSON_DEPTH = 100


_CONTAINERS = frozenset((dict, list))  # JSON's, as parsed: exactly these types


def _too_deep(data: Any) -> bool:
    """Whether `data` nests dicts and lists deeper than MAX_JSON_DEPTH (without recursing itself). Runs
    on the event loop for every body, so a list of scalars (a prompt of token ids) is passed over by a
    look at its types in C: 2M token ids take ~40 ms, a third of parsing their JSON."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return True
        items = value.values() if isinstance(value, dict) else value
        if not _CONTAINERS.isdisjoint(map(type, items)):
            stack.extend((item, depth + 1) for item in items if isinstance(item, (dict, list)))
    return False


def _json_text(text: str, what: str) -> Any:
    """JSON given as a string inside the body (a schema, a structural tag), held to the body's depth."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # nested past the parser's own depth
        raise ValueError(f"{what} given as a string must be valid JSON") from None
    if _too_deep(value):
        raise ValueError(f"{what} nests JSON deeper than {MAX_JSON_DEPTH} levels")
    return value


class RequestBody(_Request):
    """A whole request body: its nesting is checked once, before its fields are."""

    @model_validator(mode="before")
    @classmethod
    def _not_too_deep(cls, data: Any) -> Any:
        if _too_deep(data):
            raise PydanticCustomError("json_too_deep", "The request body nests JSON deeper than {limit} levels.",
                                      {"limit": MAX_JSON_DEPTH})
        return data


def _check_unicode(text: str) -> str:
    """JSON can carry lone surrogates ("\\ud800"), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid Unicode (it holds a lone surrogate)") from None
    return text


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- shared pieces ------------------------------------------------------------------------------


class PromptCacheOptions(_Request):
    mode: Literal["implicit", "explicit"] = "implicit"
    ttl: Literal["30m"] = "30m"


class StreamOptions(_Request):
    include_usage: StrictBool = False
    # vLLM's: every chunk carries the usage so far (the gateway meters a broken stream by it)
    continuous_usage_stats: StrictBool = False
    # OpenAI's (on by default there; off here, as vLLM, where the network is the operator's own): each
    # chunk padded with random characters in an `obfuscation` field, hiding its text's length
    include_obfuscation: StrictBool = False
    resumable: StrictBool = Field(False, description=(
        "llmserve: keep generating through a dropped connection for a grace period; resume with "
        "GET /v1/streams/{id} (the x-stream-id header) and Last-Event-ID."
    ))


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class CompletionTokensDetails(_Response):
    """Given for a reasoning model's chat reply: its reasoning tokens (counted in `completion_tokens` too); and with
    a predicted output: its tokens the model was given to verify and took, and those it did not (these cost compute,
    not completion tokens: `completion_tokens` counts the output alone)."""

    reasoning_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails | None = None  # a reasoning model's, a prediction's

    @model_serializer(mode="wrap")
    def _without_unset_details(self, serialize: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = serialize(self)
        if data.get("completion_tokens_details", ...) is None:
            del data["completion_tokens_details"]
        return data

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class PromptTokenLogprob(_Response):
    """vLLM's `Logprob` in its `prompt_logprobs` response field."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobsField = list[dict[int, PromptTokenLogprob] | None] | None


VLLM_RESPONSE_EXTRAS = ("prompt_logprobs", "prompt_token_ids", "token_ids", "kv_transfer_params")


def _without_unset_extras(data: dict[str, Any]) -> dict[str, Any]:
    """vLLM's response fields (`prompt_logprobs`, `prompt_token_ids`, `token_ids`) appear only when they
    were asked for: other responses keep OpenAI's shape."""
    for name in VLLM_RESPONSE_EXTRAS:
        if data.get(name, ...) is None:
            del data[name]
    return data


def _check_stop(value: Any) -> Any:
    if value is None:
        return value
    if isinstance(value, str):
        return _check_unicode(value)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        return [_check_unicode(s) for s in value]
    raise ValueError("stop must be a string or a list of strings")


# ---- structured output ----------------------------------------------------------------------------


class JsonSchemaFormat(_Request):
    """OpenAI's `response_format.json_schema`."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")  # `schema` would shadow a BaseModel method
    strict: StrictBool | None = None


class TagStructure(_Request):
    """One tag of vLLM's older `response_format` structural tag: text, JSON under a schema, text."""

    begin: str = Field(min_length=1)
    schema_: dict[str, Any] = Field(alias="schema")
    end: str


class _OlderStructuralTag(_Request):
    structures: list[TagStructure]
    triggers: list[str]


class ResponseFormat(_Request):
    """OpenAI's `response_format`: free text, any JSON object, or JSON under a schema; and vLLM's
    structural tag: xgrammar's `format`, or (older) `structures` opened by `triggers`."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[TagStructure] | None = None
    triggers: list[str] | None = None

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError("'json_schema' is only allowed with type 'json_schema'")
        tag_fields = [name for name in ("format", "structures", "triggers") if getattr(self, name) is not None]
        if self.type != "structural_tag" and tag_fields:
            raise ValueError(f"'{tag_fields[0]}' is only allowed with type 'structural_tag'")
        if self.type == "structural_tag" and tag_fields not in (["format"], ["structures", "triggers"]):
            raise ValueError("type 'structural_tag' needs either 'format' or both 'structures' and 'triggers'")
        return self

    def structural_tag(self) -> dict[str, Any]:
        """xgrammar's structural tag of a `structural_tag` response format."""
        if self.format is not None:
            return {"type": "structural_tag", "format": self.format}
        assert self.structures is not None and self.triggers is not None  # the validator checks it
        return older_structural_tag([s.model_dump(by_alias=True) for s in self.structures], self.triggers)


def older_structural_tag(structures: list[dict[str, Any]], triggers: list[str]) -> dict[str, Any]:
    """xgrammar's structural tag of vLLM's older form: `structures` ({begin, schema, end}) opened by `triggers`."""
    tags = [{"type": "tag", "begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]},
             "end": s["end"]} for s in structures]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}


def _check_json_schema(value: Any) -> Any:
    """A JSON schema as an object or as its JSON text (vLLM takes both)."""
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, str):
        parsed = _json_text(value, "a JSON schema")
        if isinstance(parsed, dict):
            return parsed
    raise ValueError("a JSON schema must be an object (or its JSON text)")


def _check_choices(value: list[str] | None) -> list[str] | None:
    if value is not None and not value:
        raise ValueError("give at least one choice")
    return value if value is None else [_check_unicode(choice) for choice in value]


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs`: exactly one constraint."""

    json_: Any = Field(None, alias="json")  # a JSON schema; `json` would shadow a BaseModel method
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    structural_tag: Any = None  # xgrammar's structural tag, as an object or its JSON text

    @field_validator("json_")
    @classmethod
    def _validate_json(cls, value: Any) -> Any:
        return _check_json_schema(value)

    @field_validator("structural_tag")
    @classmethod
    def _validate_structural_tag(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = _json_text(value, "a structural tag")
        if value is not None and not isinstance(value, dict):
            raise ValueError("a structural tag must be an object (or its JSON text)")
        if value is not None and "structures" in value:  # vLLM's older form
            older = _OlderStructuralTag.model_validate(value)
            return older_structural_tag([s.model_dump(by_alias=True) for s in older.structures], older.triggers)
        return value

    @field_validator("choice")
    @classmethod
    def _validate_choice(cls, value: list[str] | None) -> list[str] | None:
        return _check_choices(value)

    @field_validator("regex", "grammar")
    @classmethod
    def _validate_text(cls, value: str | None) -> str | None:
        return value if value is None else _check_unicode(value)

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsRequest:
        kinds = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
        given = [name for name in kinds if self.kind_set(name)]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of json, regex, choice, grammar, json_object, structural_tag"
                + (f" (got {', '.join(given)})" if given else "")
            )
        return self

    def kind_set(self, name: str) -> bool:
        value = self.json_ if name == "json" else getattr(self, name)
        return bool(value) if name == "json_object" else value is not None


class KVTransferRequest(_Request):
    """vLLM's `kv_transfer_params` (disaggregated prefill, sent by a gateway): keep the prompt's KV for another
    replica (`do_remote_decode`), or pull it from the replica that kept it (`do_remote_prefill`)."""

    do_remote_decode: StrictBool = False
    do_remote_prefill: StrictBool = False
    transfer_id: str | None = Field(None, min_length=1, max_length=64)
    remote_host: str | None = Field(None, min_length=1, max_length=253)
    remote_port: StrictInt | None = Field(None, ge=1, le=65535)
    num_tokens: StrictInt | None = None  # what the prefill replica said it holds: passed back as given


class SamplingFields(RequestBody):
    """Parameters both endpoints share, with vLLM's extras."""

    model: str | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    stop: Any = None
    seed: Int64 | None = None
    presence_penalty: StrictFloat = 0.0
    frequency_penalty: StrictFloat = 0.0
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # metadata only: accepted without effect
    user: str | None = None
    safety_identifier: str | None = Field(None, max_length=128)  # OpenAI's successor to `user`
    # `store: true` keeps the completion, listed by its metadata (server/stored_completions.py)
    metadata: Metadata | None = None
    store: StrictBool | None = None
    service_tier: str | None = None
    # OpenAI's prompt caching. This server caches every prompt's KV blocks by itself (prefix caching,
    # evicted least recently used, never kept past the process); a gateway sends requests with the same
    # key to the same replica. Neither changes the output.
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=1024)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    # vLLM's extras
    top_k: Int64 | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    min_tokens: Int64 = Field(0, ge=0)
    ignore_eos: StrictBool = False
    # at most 64: the scheduler looks each new token up in them, every step
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=64)
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    priority: Int64 = 0
    echo: StrictBool = False
    cache_salt: str | None = Field(None, min_length=1)  # keeps this request's prefix cache private
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's, per prompt token
    truncate_prompt_tokens: Int64 | None = Field(None, ge=-1)  # keep the prompt's last k tokens
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # token id (as a string, as OpenAI's) -> bias; at most 300 entries, as OpenAI: each is rebuilt every step
    logit_bias: dict[str, StrictFloat] | None = Field(None, max_length=300)
    # vLLM's: only these tokens may be sampled (a bitmask built once per request)
    allowed_token_ids: list[StrictInt] | None = Field(None, min_length=1)
    # vLLM's: words the output never contains; each is looked up every step, so at most 128 of them
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    # vLLM's: logprobs name each token `token_id:{id}` instead of its text
    return_tokens_as_token_ids: StrictBool = False
    # vLLM's: the response carries the prompt's token ids and each choice's (streamed: the prompt's in the
    # first chunk, each chunk's own)
    return_token_ids: StrictBool = False
    kv_transfer_params: KVTransferRequest | None = None  # vLLM's disaggregated prefill (--kv-transfer)
    # vLLM's beam search: the n best of n beams (llmserve.engine.beam_search), streamed as one chunk at its end
    use_beam_search: StrictBool = False
    length_penalty: StrictFloat = 1.0

    @field_validator("stop")
    @classmethod
    def _validate_stop(cls, value: Any) -> Any:
        return _check_stop(value)

    @field_validator("bad_words")
    @classmethod
    def _validate_bad_words(cls, value: list[str] | None) -> list[str] | None:
        return value if value is None else [_check_unicode(word) for word in value]

    @field_validator("guided_json")
    @classmethod
    def _validate_guided_json(cls, value: Any) -> Any:
        return _check_json_schema(value)

    @field_validator("guided_choice")
    @classmethod
    def _validate_guided_choice(cls, value: list[str] | None) -> list[str] | None:
        return _check_choices(value)

    @field_validator("guided_regex", "guided_grammar")
    @classmethod
    def _validate_guided_text(cls, value: str | None) -> str | None:
        return value if value is None else _check_unicode(value)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def engine_prompt_logprobs(self) -> int | None:
        """How many top logprobs the engine computes per prompt token (None: it scores no prompt)."""
        return self.prompt_logprobs

    def common_unsupported(self) -> list[tuple[str, str]]:
        found = []
        if self.truncate_prompt_tokens == 0:
            found.append(("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 or at least 1."))
        if self.stream_options is not None and not self.stream:
            found.append(("stream_options", "stream_options is only allowed when stream is true."))
        return found


# ---- chat completions -----------------------------------------------------------------------------

Role = Literal["system", "developer", "user", "assistant", "tool"]
MAX_TOOLS = 128  # as OpenAI
FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class FunctionDefinition(_Request):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: StrictBool | None = None


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(_Request):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallParam(_Request):
    """A tool call of an earlier assistant message, sent back in the history."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Request):
    role: Role
    content: Any = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool result's: the call it answers
    function_call: Any = None
    # An assistant's reasoning, as a reply gave it (vLLM's `reasoning_content`, or its newer `reasoning`): clients
    # send replies back as they got them, and templates that keep a turn's reasoning (Qwen3's, in a tool loop) read it
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("content")
    @classmethod
    def _check_content(cls, value: Any) -> Any:
        if value is None:
            return value
        if isinstance(value, str):
            return _check_unicode(value)
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of content parts")
        for part in value:
            if not isinstance(part, dict) or "type" not in part:
                raise ValueError("each content part must be an object with a type")
            if part["type"] == "image_url":
                _check_image_part(part)
                continue
            if part["type"] != "text":
                raise ValueError(f"content part type {part['type']!r} is not supported: only 'text' and 'image_url' are")
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a string 'text'")
            _check_unicode(part["text"])
        return value

    def text(self) -> str:
        """The text parts, joined (images are not text)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content if part["type"] == "text")

    def image_urls(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [part["image_url"]["url"] for part in self.content if part["type"] == "image_url"]


def _check_image_part(part: dict) -> None:
    """OpenAI's image part: {"type": "image_url", "image_url": {"url": a data: or http(s) URL, "detail": ...}}.
    `detail` is taken whatever it says: a vision tower reads images at its one resolution."""
    image = part.get("image_url")
    if not isinstance(image, dict) or not isinstance(image.get("url"), str):
        raise ValueError("an image_url content part needs an object 'image_url' with a string 'url'")
    if set(image) - {"url", "detail"}:
        raise ValueError(f"image_url takes 'url' and 'detail', not {sorted(set(image) - {'url', 'detail'})}")
    if image.get("detail", "auto") not in ("auto", "low", "high"):
        raise ValueError("image_url.detail must be 'auto', 'low' or 'high'")
    if not image["url"].startswith(("data:", "http://", "https://")):
        raise ValueError("image_url.url must be a data: URL (base64) or an http(s) URL")


def continuation_conflicts(continue_final_message: bool, add_generation_prompt: bool) -> list[tuple[str, str]]:
    if continue_final_message and add_generation_prompt:
        return [("continue_final_message", "continue_final_message needs add_generation_prompt set to false: the "
                 "model continues the final message instead of starting a new one.")]
    return []


class PredictedText(_Request):
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _valid_text(cls, value: str) -> str:
        return _check_unicode(value)


class PredictedOutput(_Request):
    """OpenAI's `prediction`: text the reply is expected to repeat much of (a file being edited)."""

    type: Literal["content"]
    content: str | list[PredictedText]

    @field_validator("content")
    @classmethod
    def _valid_content(cls, value: str | list[PredictedText]) -> str | list[PredictedText]:
        return _check_unicode(value) if isinstance(value, str) else value

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: Int64 | None = Field(None, ge=1)
    max_completion_tokens: Int64 | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: StrictBool = True
    # vLLM's: the model continues the final message (an assistant reply begun by the caller)
    continue_final_message: StrictBool = False
    # llmserve's extras: continue a stored conversation (its history is sent before `messages`), from
    # its latest message or, to branch (regenerate or edit a turn), from `parent_message_id`.
    conversation_id: str | None = Field(None, min_length=1)
    parent_message_id: str | None = Field(None, min_length=1)
    # The Responses API's name: "auto" drops the oldest turns that do not fit the context window (the stored
    # conversation's, or without one the messages' own before their last turn).
    truncation: Literal["auto", "disabled"] = "disabled"
    # vLLM's: more variables for the chat template (e.g. Qwen3's enable_thinking)
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the image processor's options for this request's images (Qwen2-VL's min_pixels and max_pixels)
    mm_processor_kwargs: dict[str, Any] | None = None
    # vLLM's (server/templates.py): the documents a RAG chat template reads, and a template for this request alone
    documents: list[dict[str, str]] | None = Field(None, max_length=MAX_DOCUMENTS)
    chat_template: str | None = Field(None, min_length=1)
    # OpenAI's; given to the chat template as the variable of that name (as vLLM does for gpt-oss), and a
    # 400 for a model whose template does not read it
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # vLLM's: at most this many tokens of reasoning, then its end is forced (a model served with a reasoning parser)
    thinking_token_budget: Int64 | None = Field(None, ge=0)
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # "auto" when tools are given, else "none"
    parallel_tool_calls: StrictBool | None = None
    prediction: PredictedOutput | None = None  # OpenAI's Predicted Outputs: drafts, the reply unchanged by them
    # OpenAI parameters this server does not implement
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    moderation: Any = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _validate_chat_template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _check_template_variables(value)

    def unsupported_params(self) -> list[tuple[str, str]]:
        found = self.common_unsupported()
        if self.functions:
            found.append(("functions", "functions are not supported."))
        if self.function_call not in (None, "none"):
            found.append(("function_call", "function_call is not supported."))
        if self.modalities is not None and set(self.modalities) - {"text"}:
            found.append(("modalities", "only the 'text' modality is supported."))
        for name in ("audio", "web_search_options", "verbosity"):
            if getattr(self, name) is not None:
                found.append((name, f"{name} is not supported."))
        if self.moderation is not None:
            found.append(("moderation", "moderation is not supported per request: the server screens prompts and "
                          "outputs with the safety filter it was started with (--safety-filter)."))
        if self.top_logprobs and not self.logprobs:
            found.append(("top_logprobs", "top_logprobs requires logprobs to be true."))
        found += continuation_conflicts(self.continue_final_message, self.add_generation_prompt)
        if self.continue_final_message and self.conversation_id is not None:
            found.append(("continue_final_message", "continue_final_message cannot be used with conversation_id."))
        if self.prompt_logprobs is not None and self.stream:
            found.append(("prompt_logprobs", "prompt_logprobs is not supported when streaming a chat completion "
                          "(it is on /v1/completions)."))
        for i, message in enumerate(self.messages):
            if message.function_call:
                found.append((f"messages[{i}].function_call", "function_call in messages is not supported: "
                               "use tool_calls."))
        return found

    def effective_tool_choice(self) -> ToolChoice:
        """OpenAI's default: "auto" when tools are given, "none" otherwise."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The completion budget and the name the client gave it (max_completion_tokens wins)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob] | None


def _without_none(data: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    return {key: value for key, value in data.items() if value is not None or key not in fields}


# OpenAI's tool call objects ({"id", "type", "function": {"name", "arguments"}}; a delta's also has "index").
ToolCalls = list[dict[str, Any]]


class AssistantMessage(_Response):
    """A reply; `reasoning_content` (vLLM's field) and `tool_calls` are left out when there are none."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: ToolCalls | None = None

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_none(handler(self), ("reasoning_content", "tool_calls"))


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None  # vLLM's return_token_ids

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_unset_extras(handler(self))


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobsField = None  # vLLM's
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: where a do_remote_decode request's KV is held

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_unset_extras(handler(self))


class DeltaMessage(_Response):
    """A streamed message piece; unset fields are left out (the last chunk's delta is `{}`)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: ToolCalls | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids: this chunk's

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_unset_extras(handler(self))


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: in the first chunk

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_unset_extras(handler(self))


# ---- (legacy) completions ---------------------------------------------------------------------------


def _check_prompt(value: Any) -> Any:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if isinstance(value, str):
        return _check_unicode(value)
    if isinstance(value, list) and value:
        if len(value) > MAX_PROMPTS and not all(isinstance(t, int) for t in value):
            raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed in one request")
        if all(isinstance(p, str) for p in value):
            return [_check_unicode(p) for p in value]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            return value
        if all(
            isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            for p in value
        ):
            return value
    raise ValueError(
        "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids, "
        "and must not be empty"
    )


class CompletionRequest(SamplingFields):
    prompt: Any
    max_tokens: Int64 | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # OpenAI parameters this server does not implement
    suffix: str | None = None
    best_of: StrictInt | None = None

    @field_validator("prompt")
    @classmethod
    def _validate_prompt(cls, value: Any) -> Any:
        return _check_prompt(value)

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s), one entry per engine request."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)

    def unsupported_params(self) -> list[tuple[str, str]]:
        found = self.common_unsupported()
        if self.suffix:
            found.append(("suffix", "suffix is not supported."))
        if self.best_of is not None and self.best_of != self.n:
            found.append(("best_of", "best_of is only supported when it equals n."))
        if self.store:
            found.append(("store", "store keeps chat completions (POST /v1/chat/completions); completions are not "
                          "stored."))
        return found

    @property
    def echoes_logprobs(self) -> bool:
        """`echo` with `logprobs`: the prompt's tokens and logprobs lead each choice's logprobs."""
        return self.echo and self.logprobs is not None

    def engine_prompt_logprobs(self) -> int | None:
        if not self.echoes_logprobs:
            return self.prompt_logprobs
        return max(self.logprobs or 0, self.prompt_logprobs or 0)


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobsField = None
    # vLLM's return_token_ids (streamed: the prompt's in the choice's first chunk, each chunk's own)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_unset_extras(handler(self))


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: where a do_remote_decode request's KV is held

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_unset_extras(handler(self))


# ---- models, tokenizer, errors ------------------------------------------------------------------------


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "llmserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestBody):
    model: str | None = None
    # One prompt, or several (counted in one call: the gateway reserves an embeddings batch's tokens so).
    prompt: str | list[str] | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    # As a chat request's: the tools' schemas and the template's variables are part of its prompt.
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # as a chat request's: an image's size can decide its tokens
    documents: list[dict[str, str]] | None = Field(None, max_length=MAX_DOCUMENTS)
    chat_template: str | None = Field(None, min_length=1)

    @field_validator("prompt")
    @classmethod
    def _validate_prompt(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list):
            if len(value) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts are allowed in one request")
            return [_check_unicode(text) for text in value]
        return value if value is None else _check_unicode(value)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _validate_chat_template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _check_template_variables(value)


class TokenizeResponse(_Response):
    count: int  # over every prompt
    max_model_len: int
    tokens: list[int] | list[list[int]]  # a list per prompt when `prompt` was a list
    counts: list[int] | None = None  # per prompt, when `prompt` was a list


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(_Response):
    prompt: str


class ReloadRequest(RequestBody):
    model: str | None = None  # unset: the first served model
    path: str = Field(min_length=1)  # a checkpoint directory on the server: same architecture and shapes


class LoadLoRAAdapterRequest(RequestBody):
    """vLLM's body, and the model the adapter is over (unset: the first served model)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)  # a PEFT LoRA adapter's directory on the server
    model: str | None = None


class UnloadLoRAAdapterRequest(RequestBody):
    lora_name: str = Field(min_length=1)


class ReloadResponse(_Response):
    object: Literal["reload"] = "reload"
    model: str
    path: str
    cached_blocks_forgotten: int


class ResetPrefixCacheRequest(RequestBody):
    model: str | None = None  # the served model's (or adapter's: its base model's cache); None: the default


class ResetPrefixCacheResponse(_Response):
    model: str
    cached_blocks_forgotten: int  # of the pool (blocks held by running requests stay with them)
    offloaded_blocks_dropped: int  # of the second tier (--kv-offload-gib)


class HealthResponse(_Response):
    status: Literal["ok"] = "ok"


class VersionResponse(_Response):
    version: str


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


# ---- embeddings ---------------------------------------------------------------------------------


def _check_input(value: Any) -> Any:
    """An embeddings `input`: as a completions prompt (a string, strings, token ids, or lists of them)."""
    try:
        return _check_prompt(value)
    except ValueError:
        raise ValueError(
            "input must be a non-empty string, a list of strings, a list of token ids or a list of lists of "
            "token ids, and must not be empty"
        ) from None


class PooledInputRequest(RequestBody):
    """A request whose `input` (a text, texts, token ids or lists of them) is pooled, one engine request each."""

    model: str | None = None
    input: Any
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: Int64 | None = Field(None, ge=-1)
    priority: Int64 = 0

    @field_validator("input")
    @classmethod
    def _validate_input(cls, value: Any) -> Any:
        return _check_input(value)

    def inputs(self) -> list[str | list[int]]:
        """The input(s), one engine request each."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if all(isinstance(t, int) for t in value):
            return [list(value)]
        return list(value)


class EmbeddingRequest(PooledInputRequest):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = Field(None, ge=1)


class ClassificationRequest(PooledInputRequest):
    """vLLM's /classify: each input's label probabilities by a sequence-classification model."""


class ModerationRequest(RequestBody):
    """OpenAI's /v1/moderations: whether each text is harmful, and in which categories (platform/moderation.py).
    `input` is a text, a list of texts (a result each), or a list of content parts read as one text (one
    result); an image part is a 400: only text is moderated here."""

    model: str | None = None
    input: str | list[Any]
    priority: Int64 = 0  # vLLM's extra, as the pooling endpoints': a classifier's requests run by it

    @field_validator("input")
    @classmethod
    def _validate_input(cls, value: str | list[Any]) -> str | list[Any]:
        if isinstance(value, str):
            return _check_unicode(value)
        if not value:
            raise ValueError("input must not be empty")
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"input may hold at most {MAX_PROMPTS} texts")
        if all(isinstance(item, str) for item in value):
            return [_check_unicode(item) for item in value]
        if all(isinstance(item, dict) for item in value):
            return [_moderated_part(i, part) for i, part in enumerate(value)]
        raise ValueError("input must be a string, a list of strings, or a list of content parts")

    def texts(self) -> list[str]:
        """The texts moderated, a result each: content parts are one text, joined by new lines."""
        if isinstance(self.input, str):
            return [self.input]
        if all(isinstance(item, str) for item in self.input):
            return list(self.input)
        return ["\n".join(part["text"] for part in self.input)]


def _moderated_part(index: int, part: dict[str, Any]) -> dict[str, Any]:
    kind = part.get("type")
    if kind == "image_url":
        raise ValueError(f"input[{index}] is an image: only text is moderated here")
    if kind != "text" or not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
        raise ValueError(f'input[{index}] must be a text part, {{"type": "text", "text": "..."}}')
    return {"type": "text", "text": _check_unicode(part["text"])}


def list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's shape of one page of a list (its items carry an `id`)."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def texts_by_field(items: Sequence[str | list[int]], params: Sequence[str]) -> dict[str, list[str]]:
    """The text items by the request field each came from ("input" for "input[3]"): what the safety screen
    reads, naming the field of a blocked one."""
    fields: dict[str, list[str]] = {}
    for item, param in zip(items, params, strict=True):
        if isinstance(item, str):
            fields.setdefault(param.partition("[")[0], []).append(item)
    return fields


class ScoredTexts:
    """A score or rerank request's texts, each once (a text asked for twice is embedded once), with the field
    each first came from (`params`, named in its errors) and its place among them (`at`)."""

    def __init__(self, named: list[tuple[str, str]]) -> None:
        first_field: dict[str, str] = {}
        for text, param in named:
            first_field.setdefault(text, param)
        self.items, self.params = list(first_field), list(first_field.values())
        self.at = {text: i for i, text in enumerate(self.items)}


def _named(texts: list[str], field: str, listed: bool) -> list[tuple[str, str]]:
    """Each text with the request field it came from: `field`, or `field[i]` when the field is a list."""
    return [(text, f"{field}[{i}]" if listed else field) for i, text in enumerate(texts)]


MAX_SCORED_TEXTS = 2048  # texts one scoring request may compare: each is an engine request


def _count(texts: str | list[str]) -> int:
    return 1 if isinstance(texts, str) else len(texts)


def _scored_texts(value: Any, name: str) -> Any:
    texts = [value] if isinstance(value, str) else value
    if not texts or not all(isinstance(t, str) and t for t in texts):
        raise ValueError(f"{name} must be a non-empty string or a non-empty list of them")
    if len(texts) > MAX_SCORED_TEXTS:
        raise ValueError(f"{name} may hold at most {MAX_SCORED_TEXTS} texts, got {len(texts)}")
    return value


class ScoreRequest(RequestBody):
    """vLLM's score API: `text_1` (one text, or one per `text_2`) against each of `text_2`."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: Int64 | None = Field(None, ge=-1)
    user: str | None = None
    priority: Int64 = 0

    @field_validator("text_1", "text_2")
    @classmethod
    def _validate_texts(cls, value: Any, info: ValidationInfo) -> Any:
        value = _scored_texts(value, info.field_name)
        firsts = info.data.get("text_1")
        if info.field_name == "text_2" and isinstance(firsts, list) and len(firsts) not in (1, _count(value)):
            raise ValueError(f"text_1 holds {len(firsts)} texts: it must hold one, or as many as text_2 "
                             f"({_count(value)})")
        return value

    def texts(self) -> tuple[list[str], list[str]]:
        return ([self.text_1] if isinstance(self.text_1, str) else self.text_1,
                [self.text_2] if isinstance(self.text_2, str) else self.text_2)

    def scored_texts(self) -> ScoredTexts:
        firsts, seconds = self.texts()
        return ScoredTexts(_named(firsts, "text_1", isinstance(self.text_1, list))
                           + _named(seconds, "text_2", isinstance(self.text_2, list)))

    def scored_pairs(self, texts: ScoredTexts) -> list[tuple[int, int]]:
        """The pairs scored, as places in `texts`: one text_1 with each text_2, or each with its own."""
        firsts, seconds = self.texts()
        return [(texts.at[firsts[0] if len(firsts) == 1 else firsts[i]], texts.at[second])
                for i, second in enumerate(seconds)]


class RerankDocument(_Request):
    text: str


class RerankRequest(RequestBody):
    """The rerank API of Jina and Cohere (v1 and v2), as vLLM serves it: `documents` ordered by relevance to
    `query`. Cohere's fields that change the answer and are not served here (`rank_fields`, `max_chunks_per_doc`)
    are unknown fields, so 400s."""

    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[str | RerankDocument] = Field(min_length=1, max_length=MAX_SCORED_TEXTS - 1)
    top_n: Int64 | None = Field(None, ge=0)  # 0 or unset: every document
    return_documents: StrictBool = True
    truncate_prompt_tokens: Int64 | None = Field(None, ge=-1)
    user: str | None = None
    priority: Int64 = 0

    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]

    def scored_texts(self) -> ScoredTexts:
        return ScoredTexts([(self.query, "query"), *_named(self.document_texts(), "documents", True)])

    def scored_pairs(self, texts: ScoredTexts) -> list[tuple[int, int]]:
        """The pairs scored, as places in `texts`: the query with each document."""
        return [(texts.at[self.query], texts.at[document]) for document in self.document_texts()]


class Embedding(_Response):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # float values, or their float32 bytes in base64


class EmbeddingUsage(_Response):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Response):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
