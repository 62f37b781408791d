"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, run as the chat completion of the
same conversation (`anthropic_api`) by this server's chat endpoint, and its prompt counted as /tokenize counts a
chat prompt."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from llmserve.errors import InvalidRequestError
from llmserve.server import errors
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
from llmserve.server.protocol import TokenizeRequest
from llmserve.server.tokens import tokenize

router = APIRouter()


@router.post("/v1/messages", response_model=None, responses=DOCUMENTED)
async def create_message(body: MessagesRequest, request: Request) -> Response:
    return await answer(body, lambda chat, _: create_chat_completion(chat, request))


@router.post("/v1/messages/count_tokens", responses=documented(TokenCount))
async def count_message_tokens(body: CountTokensRequest, request: Request) -> JSONResponse:
    try:
        prompt = TokenizeRequest.model_validate(count_request(body))
    except ValidationError as exc:
        param = errors.param_path(exc.errors()[0].get("loc", ()))
        raise InvalidRequestError(f"Invalid value for '{param}': {exc.errors()[0].get('msg')}", param="messages") from None
    counted = await tokenize(prompt, request)
    return JSONResponse({"input_tokens": json.loads(bytes(counted.body))["count"]})
