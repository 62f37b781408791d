"""The Responses API's shapes (OpenAI's `/v1/responses`): the request, the `input_tokens` request, the response
object, as far as this server serves them (`responses_api` translates a request into a chat completion)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat

from llmserve.server.openapi import documented
from llmserve.server.protocol import Int64, Metadata, RequestBody

# `include` values: what they add to items this server makes (logprobs, reasoning), or to items of tools and
# inputs it refuses (so there is never anything of theirs to add).
LOGPROBS = "message.output_text.logprobs"
ENCRYPTED_REASONING = "reasoning.encrypted_content"
Includable = Literal[
    "message.output_text.logprobs", "reasoning.encrypted_content", "web_search_call.action.sources",
    "web_search_call.results", "code_interpreter_call.outputs", "computer_call_output.output.image_url",
    "file_search_call.results", "message.input_image.image_url",
]


class ConversationRef(BaseModel):
    """`conversation` as an object: the stored conversation's id."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1)


class ResponsesRequest(RequestBody):
    """The Responses API's request, as far as it is served here (other fields are 400s)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int64 | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, ge=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None  # "auto": the oldest turns go when the context is full
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    store: StrictBool | None = None  # unset: stored where responses are kept (OpenAI's default)
    background: StrictBool | None = None  # true: answered queued at once, then run by a task of the process
    previous_response_id: str | None = Field(None, min_length=1, max_length=64)
    conversation: ConversationRef | Annotated[str, Field(min_length=1)] | None = None  # its id, or {"id": ...}
    # metadata only
    metadata: Metadata | None = None
    user: str | None = None
    safety_identifier: str | None = Field(None, max_length=128)
    prompt_cache_key: str | None = Field(None, min_length=1, max_length=1024)
    service_tier: str | None = None
    include: list[Includable] | None = None
    top_logprobs: Int64 | None = Field(None, ge=0, le=20)  # with logprobs, whether `include` asks for them or not
    # Calls of built-in tools allowed: this server runs none (its tools are the client's functions), so none is made.
    max_tool_calls: Int64 | None = Field(None, ge=1)
    # known, not served
    prompt: Any = None


class InputTokensRequest(RequestBody):
    """POST /v1/responses/input_tokens: what a Responses request's input tokens depend on."""

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=64)
    conversation: ConversationRef | Annotated[str, Field(min_length=1)] | None = None


class InputTokens(BaseModel):
    object: Literal["response.input_tokens"]
    input_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    """A response, as the Responses API answers it (the fields this server fills)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed", "queued", "cancelled"]
    model: str
    output: list[dict[str, Any]]
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: int | None = None
    temperature: float | None
    top_p: float | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    truncation: Literal["auto", "disabled"]
    store: bool
    background: bool = False
    metadata: dict[str, str]
    user: str | None
    previous_response_id: str | None
    conversation: ConversationRef | None = None
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None
    usage: ResponseUsage | None


# Streamed, each event names its type (`event:`) as OpenAI's do, besides the JSON in `data:`.
DOCUMENTED = documented(ResponseObject, stream=True)
DOCUMENTED[200]["content"]["text/event-stream"]["schema"] = {
    "type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"}}, "required": ["data"],
}



def conversation_ref(body: ResponsesRequest) -> ConversationRef | None:
    """The stored conversation the request names, as the response echoes it."""
    return ConversationRef(id=body.conversation) if isinstance(body.conversation, str) else body.conversation
