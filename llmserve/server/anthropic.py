"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, run as the chat completion of the
same conversation (`anthropic_api`) by this server's chat endpoint, and its prompt counted as /tokenize counts a
chat prompt."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from llmserve.server.anthropic_api import (
    DOCUMENTED,
    CountTokensRequest,
    MessagesRequest,
    TokenCount,
    answer,
    count_request,
)
from llmserve.server.chat import create_chat_completion
from llmserve.server.openapi import documented
from llmserve.server.tokens import count_chat_tokens

router = APIRouter()


@router.post("/v1/messages", response_model=None, responses=DOCUMENTED)
async def create_message(body: MessagesRequest, request: Request) -> Response:
    return await answer(body, lambda chat, _: create_chat_completion(chat, request))


@router.post("/v1/messages/count_tokens", responses=documented(TokenCount))
async def count_message_tokens(body: CountTokensRequest, request: Request) -> JSONResponse:
    return JSONResponse({"input_tokens": await count_chat_tokens(count_request(body), request, "messages")})
