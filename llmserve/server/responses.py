"""POST /v1/responses: OpenAI's Responses API, run as the chat completion of the same conversation
(`responses_api`) by this server's chat endpoint, and kept in the platform's store (`stored_responses`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from llmserve.server.chat import create_chat_completion
from llmserve.server.responses_api import DOCUMENTED, ResponsesRequest, answer
from llmserve.server.stored_responses import storage_for

router = APIRouter()


@router.post("/v1/responses", response_model=None, responses=DOCUMENTED)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    return await answer(body, lambda chat, _: create_chat_completion(chat, request), storage_for(request))
