"""POST /v1/responses: OpenAI's Responses API, run as the chat completion of the same conversation
(`responses_api`) by this server's chat endpoint, and kept in the platform's store (`stored_responses`); in
background, on the request `detached` from the client's connection; and POST /v1/responses/input_tokens, which
counts that chat completion's prompt as /tokenize counts it."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from llmserve.server.chat import create_chat_completion
from llmserve.server.openapi import documented
from llmserve.server.responses_api import answer, detached, input_token_request
from llmserve.server.responses_protocol import DOCUMENTED, InputTokens, InputTokensRequest, ResponsesRequest
from llmserve.server.stored_responses import storage_for
from llmserve.server.tokens import count_chat_tokens

router = APIRouter()


@router.post("/v1/responses", response_model=None, responses=DOCUMENTED)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    chat_request = detached(request) if body.background else request
    return await answer(body, lambda chat, _: create_chat_completion(chat, chat_request), storage_for(request))


@router.post("/v1/responses/input_tokens", responses=documented(InputTokens))
async def count_input_tokens(body: InputTokensRequest, request: Request) -> JSONResponse:
    """The input tokens of the response `body` describes (its instructions, the conversation it continues, its
    input and its tools), as its chat completion's prompt counts them."""
    count = await count_chat_tokens(await input_token_request(body, storage_for(request)), request, "input")
    return JSONResponse({"object": "response.input_tokens", "input_tokens": count})
